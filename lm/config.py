"""The config schema, loading from Python files, dotted overrides and validation.

`base_config()` is the schema: every key that exists, with its default and type.
A config file defines `get_config()` returning a ConfigDict whose keys must all
exist in the schema; its values are merged over the defaults and checked.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib

import ml_collections

from lm.config_checks import require as _require, validate_stages
from lm.errors import UserError

ConfigDict = ml_collections.ConfigDict

# Logical axis -> mesh axes. ONE table; a config may override entries via mesh.rules.
DEFAULT_RULES = {
    # activations
    "batch": ("data", "fsdp"),
    "length": (),
    "cache_length": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    # params
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": (),
    "lora_rank": (),
    "position": (),
    "norm": (),
}

# The projections LoRA can adapt (lm.model.lora), by param name.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in")

CHOICES = {
    "model.mlp": ("swiglu", "gelu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned"),
    "model.compute_dtype": ("float32", "bfloat16"),
    "model.attention": ("xla", "cudnn", "reference", "blockwise"),
    "model.remat": ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
    # "cpu": lm.model.cpu_kernels (hand-written backward passes for XLA:CPU); "plain": einsum +
    # autodiff, which XLA fuses on GPU/TPU; "auto": cpu on the CPU backend, plain elsewhere
    "model.kernels": ("auto", "cpu", "plain"),
    "train.on_bad": ("restore", "stop"),
    "curate.on_bad_record": ("error", "skip"),
    "sft.truncation": ("drop", "cut_prompt_left", "cut_response"),
    "sft.train_on": ("all", "last"),
    "sft.on_bad_record": ("error", "skip"),
    "pairs.truncation": ("drop", "cut_prompt_left", "cut_response"),
    "pairs.on_bad_record": ("error", "skip"),
    "dpo.loss": ("sigmoid", "ipo", "simpo"),
    "dpo.reference": ("live", "precomputed"),
    "rl.algo": ("grpo", "ppo"),
    "rl.on_bad_record": ("error", "skip"),
}


def base_config() -> ConfigDict:
    """Every key with its default. Defaults are the tiny CPU model."""
    c = ConfigDict()
    c.model = dict(
        vocab_size=320, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=0,
        d_ff=384, mlp="swiglu", norm="rmsnorm", use_bias=False, position="rope",
        max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
        compute_dtype="float32", attention="blockwise", remat="none", init_std=0.02, kernels="auto",
        # LoRA (lm.model.lora): rank 0 = off; targets among wq wk wv wo w_gate w_up w_down w_in
        lora_rank=0, lora_alpha=16.0, lora_dropout=0.0,
        lora_targets=LORA_TARGETS,
    )
    # sources: ("SPEC:WEIGHT", ...) mixed by weight; SPEC is a corpus ('stdlib', dir, glob) or an
    # `lm tokenize` output dir; empty = data.corpus alone. tokenizer: 'byte', a .model, or 'spm:VOCAB'
    # (trained on the first corpus). curate: run each corpus through `curate` (section below) first.
    # workers: processes for curating and tokenizing (0 = all cores). cache_dir: prepared data shared
    # by runs ('' = $LM_CACHE_DIR, else $XDG_CACHE_HOME/lm or ~/.cache/lm)
    c.data = dict(
        corpus="stdlib", sources=(), tokenizer="byte", seq_len=256, heldout_fraction=0.02,
        max_train_bytes=0, cache_dir="", curate=False, workers=0,
    )
    c.optim = dict(
        lr=3e-3, min_lr_ratio=0.1, warmup_steps=50, decay_steps=0, b1=0.9, b2=0.95,
        eps=1e-8, weight_decay=0.1, decay_embeddings=False, decay_norms_and_biases=False,
        grad_clip=1.0, z_loss=0.0,
    )
    c.train = dict(
        steps=500, batch_size=16, micro_batches=1, seed=0, log_every=10,
        peak_flops=0.0, sample_tokens=200, sample_prompt="def",  # no trailing space: BPE attaches it to the next word
        # numerical faults: non-finite steps are skipped; after max_bad_steps in a row, or a loss
        # spike (loss > median + spike_threshold * robust std over spike_window steps; 0 = off),
        # on_bad restores the last good checkpoint and skips ahead in the data, or stops
        max_bad_steps=5, on_bad="restore", spike_window=0, spike_threshold=8.0, max_rollbacks=3,
    )
    # sets: ("NAME=PATH", ...) language-modelling sets (text, {"text"} JSONL, corpus, token shards)
    # scored at every eval, at most set_tokens tokens each: eval/NAME/loss and eval/NAME/bits_per_byte
    c.eval = dict(every_steps=100, batches=8, batch_size=16, sets=(), set_tokens=65536)
    # keep the newest `keep` plus every step divisible by keep_period (0 = none); every_minutes
    # adds timed saves (0 = off); processes agree on signals and timed saves every agree_every_steps
    c.checkpoint = dict(every_steps=100, every_minutes=0.0, keep=3, keep_period=0, agree_every_steps=5)
    c.mesh = dict(data=-1, fsdp=1, tensor=1, rules=dict(DEFAULT_RULES))
    # `lm sft`: init is the run or export to start from; data / eval_data JSONL conversations (chat
    # or instruction lines). epochs > 0 sets train.steps (0: train.steps as given). truncation of
    # over-long examples: drop | cut_prompt_left | cut_response; train_on: all | last assistant
    # turns; an example left with no assistant token is skipped, more than max_skipped_fraction of
    # them stops the run. eval_examples held-out conversations are answered greedily at the end.
    c.sft = dict(init="", data="", eval_data="", epochs=3.0, truncation="drop", train_on="all",
                 on_bad_record="error", max_skipped_fraction=0.05, eval_examples=256, eval_max_new_tokens=64)
    # `lm dpo` and `lm reward`: preference pairs {"prompt", "chosen", "rejected"[, "margin"]} in JSONL.
    # init, epochs, truncation, on_bad_record, max_skipped_fraction as for sft; eval_pairs held-out
    # pairs are scored at every eval; eval_answers: held-out conversations (chat JSONL) answered
    # greedily by the initial and the tuned model at the end ('' = none)
    c.pairs = dict(init="", data="", eval_data="", epochs=1.0, truncation="drop", on_bad_record="error",
                   max_skipped_fraction=0.05, eval_pairs=256, eval_answers="", eval_examples=256,
                   eval_max_new_tokens=64)
    # `lm dpo`: loss sigmoid (DPO; label_smoothing > 0: conservative DPO) | ipo | simpo (no reference,
    # length-normalised, margin simpo_gamma); rpo_alpha: weight of an NLL term on the chosen response;
    # reference: live (the init model runs beside the policy, frozen, in the compute dtype; with LoRA:
    # the base with adapters off) | precomputed (its log-probs, computed once before training)
    c.dpo = dict(loss="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, rpo_alpha=0.0, reference="live")
    # `lm reward`: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) + center_coef *
    # (r_chosen + r_rejected)^2 (keeps scores centred at 0); margin is the pair's "margin" field
    c.reward = dict(center_coef=0.0)
    # `lm rl`: GRPO or PPO from a trained model (init) on prompts (data, eval_data: JSONL {"prompt"}
    # or chat {"messages"} lines, lm.data.prompts). A step samples group_size responses to each of
    # prompts_per_step prompts (max_new_tokens, temperature, top_p), scores them (rewards:
    # "module:function[=weight], file.py:function"; reward_model: an `lm reward` run or export,
    # times reward_model_weight; truncation_penalty off responses cut at max_new_tokens), then makes
    # epochs passes over them in minibatches updates (train.batch_size is set to the rows of one).
    # beta: KL to the init model (GRPO: k3 term in the loss; PPO: in the per-token reward; 0: no
    # reference held); eps_low/eps_high: the clip range; scale_rewards: GRPO divides by the group's
    # std (false: Dr. GRPO); PPO: gamma, lam (GAE), vf_coef, value_clip, whiten. eval_prompts
    # held-out prompts are answered greedily at every eval; eval_answers as for pairs.
    c.rl = dict(init="", data="", eval_data="", algo="grpo", prompts_per_step=8, group_size=8, max_new_tokens=32,
                temperature=1.0, top_p=1.0, rewards="", reward_model="", reward_model_weight=1.0,
                truncation_penalty=0.0, epochs=1, minibatches=1, beta=0.04, eps_low=0.2, eps_high=0.2,
                scale_rewards=True, adv_eps=1e-4, gamma=1.0, lam=0.95, vf_coef=0.1, value_clip=0.2, whiten=True,
                on_bad_record="error", max_skipped_fraction=0.01, eval_prompts=256, eval_answers="",
                eval_examples=256, eval_max_new_tokens=64)
    c.curate = curate_defaults()
    return c


def curate_defaults() -> dict:
    """`lm curate`: every stage on, with the thresholds published with each rule set
    (Gopher: Rae et al. 2021; C4: Raffel et al. 2020; FineWeb: Penedo et al. 2024). These suit
    web prose; for source code turn the prose rules off (see lm/data/curate/__init__.py)."""
    return dict(
        on_bad_record="error",  # "error": stop, naming file and line; "skip": count and skip
        text_key="text",  # the text field of .jsonl / .parquet inputs
        tasks=0,  # shards of work (and output files); 0 = one per 8 MB of input
        exact_dedup=dict(enabled=True),
        near_dedup=dict(enabled=True, ngrams=5, bands=14, rows=8),  # MinHash LSH, 112 hashes
        language=dict(enabled=True, keep=("en",), threshold=0.65),
        gopher_repetition=dict(
            enabled=True, dup_line_frac=0.3, dup_para_frac=0.3, dup_line_char_frac=0.2,
            dup_para_char_frac=0.2, top_n_grams=("2:0.20", "3:0.18", "4:0.16"),
            dup_n_grams=("5:0.15", "6:0.14", "7:0.13", "8:0.12", "9:0.11", "10:0.10"),
        ),
        gopher_quality=dict(
            enabled=True, min_doc_words=50, max_doc_words=100000, min_avg_word_length=3,
            max_avg_word_length=10, max_symbol_word_ratio=0.1, max_bullet_lines_ratio=0.9,
            max_ellipsis_lines_ratio=0.3, max_non_alpha_words_ratio=0.8, min_stop_words=2,
        ),
        c4=dict(
            enabled=True, split_paragraph=True, remove_citations=True, filter_no_terminal_punct=True,
            min_num_sentences=5, min_words_per_line=3, max_word_length=1000, filter_lorem_ipsum=True,
            filter_javascript=True, filter_curly_bracket=True, filter_policy=True,
        ),
        fineweb=dict(
            enabled=True, line_punct_thr=0.12, line_punct_exclude_zero=False, short_line_thr=0.67,
            short_line_length=30, char_duplicates_ratio=0.01, new_line_ratio=0.3,
        ),
        word_list=dict(enabled=False, path="", max_hits=0),  # a local file, one word per line
        pii=dict(enabled=True, emails=True, ips=True, phones=True),
    )


def _suggest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(options))})"


def _check_type(key: str, value, default):
    """Returns value coerced to the default's type, or raises naming the key."""
    want = type(default)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, want)
    if not ok:
        raise UserError(f"config key '{key}': expected {want.__name__}, got {value!r} ({type(value).__name__})")
    return value


def merge(base: ConfigDict, user, prefix: str = "") -> None:
    """Merges `user` (ConfigDict or dict) into `base` in place, checking keys and types."""
    for key, value in user.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            if prefix == "mesh.rules.":  # the rule table accepts new logical names
                base[key] = _check_type(dotted, value, ())
                continue
            raise UserError(f"unknown config key '{dotted}'{_suggest(key, base.keys())}")
        default = base[key]
        if isinstance(default, ConfigDict):
            if not isinstance(value, (ConfigDict, dict)):
                raise UserError(f"config key '{dotted}': expected a section, got {value!r}")
            merge(default, value, dotted + ".")
        else:
            base[key] = _check_type(dotted, value, default)


def _parse_scalar(key: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise UserError(f"config key '{key}': expected true/false, got '{text}'")
    if isinstance(default, (int, float)):
        try:
            return type(default)(text) if isinstance(default, float) else int(text)
        except ValueError:
            raise UserError(f"config key '{key}': expected {type(default).__name__}, got '{text}'") from None
    if isinstance(default, tuple):
        return tuple(s for s in text.split(",") if s)
    return text


def apply_overrides(config: ConfigDict, overrides: list[str]) -> None:
    """Applies `a.b.c=value` strings, typed by the current value of the key."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"override '{item}': expected key=value, e.g. optim.lr=1e-3")
        node, parts = config, key.split(".")
        for i, part in enumerate(parts):
            dotted = ".".join(parts[: i + 1])
            last = i == len(parts) - 1
            if part not in node:
                if last and dotted.startswith("mesh.rules."):
                    node[part] = ()
                else:
                    raise UserError(f"unknown config key '{dotted}'{_suggest(part, node.keys())}")
            if last:
                if isinstance(node[part], ConfigDict):
                    raise UserError(f"config key '{dotted}' is a section; set one of its keys")
                node[part] = _parse_scalar(dotted, text, node[part])
            else:
                node = node[part]


def load_config(path: str | None, overrides: list[str] = ()) -> ConfigDict:
    """Loads a config file's get_config(), merges it over the schema, applies overrides, validates."""
    config = base_config()
    if path:
        merge(config, load_file(path))
    apply_overrides(config, list(overrides))
    validate(config)
    return config


def load_file(path: str) -> ConfigDict:
    p = pathlib.Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist; pass e.g. --config configs/tiny.py")
    spec = importlib.util.spec_from_file_location(f"_lm_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is user input
        raise UserError(f"config file '{path}' failed to load: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_config"):
        raise UserError(f"config file '{path}' has no get_config() function")
    try:
        return module.get_config()
    except Exception as e:
        raise UserError(f"config file '{path}': get_config() failed: {type(e).__name__}: {e}") from None


def validate(c: ConfigDict) -> None:
    """Consistency checks across keys; each error names the key, value and expectation."""
    for key, options in CHOICES.items():
        section, name = key.split(".")
        _require(c[section][name] in options, key, c[section][name], f"expected one of {options}")
    m = c.model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        _require(m[key] > 0, f"model.{key}", m[key], "expected a positive integer")
    _require(m.head_dim > 0 or m.d_model % m.n_heads == 0, "model.n_heads", m.n_heads,
             f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    _require(m.lora_rank >= 0, "model.lora_rank", m.lora_rank, "expected >= 0 (0 = no adapters)")
    _require(m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "expected > 0")
    _require(0.0 <= m.lora_dropout < 1.0, "model.lora_dropout", m.lora_dropout, "expected a rate in [0, 1)")
    _require(set(m.lora_targets) <= set(LORA_TARGETS) and m.lora_targets, "model.lora_targets", m.lora_targets,
             f"expected names among {LORA_TARGETS}")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_heads={m.n_heads}")
    _require(m.position != "rope" or _head_dim(m) % 2 == 0, "model.head_dim", _head_dim(m),
             "RoPE needs an even head dimension")
    _require(c.data.seq_len <= m.max_seq_len, "data.seq_len", c.data.seq_len,
             f"must be <= model.max_seq_len={m.max_seq_len}")
    _validate_sources(c.data)
    parse_sets(c.eval.sets)
    _require(c.eval.set_tokens > 0, "eval.set_tokens", c.eval.set_tokens, "expected > 0")
    _require(c.data.workers >= 0, "data.workers", c.data.workers, "expected >= 0 (0 = all cores)")
    _require(0.0 < c.data.heldout_fraction < 1.0, "data.heldout_fraction", c.data.heldout_fraction,
             "expected a fraction in (0, 1)")
    t = c.train
    _require(t.steps > 0, "train.steps", t.steps, "expected a positive integer")
    _require(t.micro_batches > 0 and t.batch_size % t.micro_batches == 0, "train.micro_batches",
             t.micro_batches, f"must be positive and divide train.batch_size={t.batch_size}")
    for key in ("max_bad_steps", "max_rollbacks"):
        _require(t[key] >= 1, f"train.{key}", t[key], "expected a positive integer")
    _require(t.spike_window == 0 or t.spike_window >= 8, "train.spike_window", t.spike_window,
             "expected 0 (off) or at least 8 steps")
    _require(t.spike_threshold > 0, "train.spike_threshold", t.spike_threshold, "expected > 0")
    k = c.checkpoint
    for key in ("every_steps", "keep_period"):
        _require(k[key] >= 0, f"checkpoint.{key}", k[key], "expected >= 0 (0 = off)")
    _require(k.every_minutes >= 0, "checkpoint.every_minutes", k.every_minutes, "expected >= 0 (0 = off)")
    _require(k.keep >= 1, "checkpoint.keep", k.keep, "expected a positive integer")
    _require(k.agree_every_steps >= 1, "checkpoint.agree_every_steps", k.agree_every_steps,
             "expected a positive integer")
    _require(c.optim.lr > 0, "optim.lr", c.optim.lr, "expected a positive learning rate")
    validate_stages(c)
    _require(0 <= c.optim.warmup_steps, "optim.warmup_steps", c.optim.warmup_steps, "expected >= 0")
    for axis in ("data", "fsdp", "tensor"):
        _require(c.mesh[axis] == -1 or c.mesh[axis] > 0, f"mesh.{axis}", c.mesh[axis],
                 "expected a positive size or -1 (whatever devices are left)")
    _require(sum(c.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) <= 1, "mesh", c.mesh.to_dict(),
             "at most one axis may be -1")
    for name, axes in c.mesh.rules.items():
        for axis in axes:
            _require(axis in ("data", "fsdp", "tensor"), f"mesh.rules.{name}", axes,
                     "expected mesh axes among data, fsdp, tensor")


def data_sources(d) -> list[tuple[str, float]]:
    """data.sources entries 'SPEC' or 'SPEC:WEIGHT' -> [(spec, weight)]; empty means data.corpus alone.

    Text after the last ':' is a weight if it is a number; otherwise the whole entry must be an
    existing path (one with a ':' in its name), else it is a mistyped weight."""
    if not d.sources:
        return [(d.corpus, 1.0)]
    out = []
    for i, entry in enumerate(d.sources):
        spec, sep, weight = entry.rpartition(":")
        if not (sep and spec):
            out.append((entry, 1.0))
            continue
        try:
            out.append((spec, float(weight)))
        except ValueError:
            if not pathlib.Path(entry).exists():
                raise UserError(f"data.sources[{i}] = {entry!r}: the weight after ':' must be a number "
                                "(SPEC or SPEC:WEIGHT)") from None
            out.append((entry, 1.0))  # the ':' belongs to the path
    return out


def parse_sets(specs) -> list[tuple[str, str]]:
    """eval.sets entries 'NAME=PATH' -> [(name, path)] (lm.eval.during scores them)."""
    out = []
    for i, spec in enumerate(specs):
        name, eq, path = str(spec).partition("=")
        if not eq or not name or not path or "/" in name:
            raise UserError(f"eval.sets[{i}] = {spec!r}: expected NAME=PATH (a text file, {{\"text\"}} JSONL, "
                            "corpus or token shard set)")
        out.append((name, path))
    return out


def _validate_sources(d) -> None:
    """Each weight >= 0 and finite; together they must sum to a positive number."""
    if not d.sources:
        return
    parsed = data_sources(d)
    for i, (spec, weight) in enumerate(parsed):
        _require(bool(spec), f"data.sources[{i}]", d.sources[i], "expected SPEC or SPEC:WEIGHT")
        _require(0 <= weight < float("inf"), f"data.sources[{i}]", d.sources[i],
                 "expected a finite weight >= 0 after the last ':'")
    _require(sum(w for _, w in parsed) > 0, "data.sources", d.sources, "the weights must sum to a positive number")


def _head_dim(m) -> int:
    return m.head_dim or m.d_model // m.n_heads


def rules_table(c: ConfigDict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The logical-axis rule table as the hashable sequence flax expects."""
    return tuple((name, tuple(axes) if axes else None) for name, axes in sorted(c.mesh.rules.items()))


# Fine-tuning settings (`lm sft`, `lm dpo`, `lm reward`, `lm rl`) that differ from pretraining's (a config
# file or overrides may change each): a tenth of the pretraining peak learning rate, a short warmup,
# decay to 0, no weight decay.
FINETUNE_DEFAULTS = {"optim.warmup_steps": 10, "optim.min_lr_ratio": 0.0, "optim.weight_decay": 0.0,
                     "eval.every_steps": 50, "checkpoint.every_steps": 100, "train.log_every": 10}
FINETUNE_LR_FRACTION = 0.1


def finetune_config(start: ConfigDict, path: str | None = None, overrides=(), section: str = "sft",
                    **keys) -> ConfigDict:
    """The config of a fine-tuning run: the schema, the fine-tuning defaults, the model and sequence
    length of the run it starts from (`start`, its config), then `path` (only the keys its
    get_config() sets), `keys` (values of `section`, e.g. sft.init, from the command line) and the
    overrides; validated."""
    c = base_config()
    c.model = ConfigDict(start.model.to_dict())
    c.data.update(seq_len=start.data.seq_len, cache_dir=start.data.cache_dir)
    c.optim.lr = start.optim.lr * FINETUNE_LR_FRACTION
    apply_overrides(c, [f"{k}={v}" for k, v in FINETUNE_DEFAULTS.items()])
    if path:
        merge(c, load_file(path))
    c[section].update({k: v for k, v in keys.items() if v is not None})
    apply_overrides(c, list(overrides))
    validate(c)
    return c


def init_of(config) -> str:
    """The model a fine-tuning run started from (its base, for LoRA adapters): '' for pretraining."""
    return config.sft.init or config.pairs.init or config.rl.init
