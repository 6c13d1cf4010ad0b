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

from lm.errors import UserError

ConfigDict = ml_collections.ConfigDict

# Logical axis -> mesh axes. ONE table; a config may override entries via mesh.rules.
DEFAULT_RULES = {
    # activations
    "batch": ("data", "fsdp"),
    "length": (),
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
    "position": (),
    "norm": (),
}

CHOICES = {
    "model.mlp": ("swiglu", "gelu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned"),
    "model.compute_dtype": ("float32", "bfloat16"),
    "model.attention": ("xla", "cudnn", "reference"),
    "model.remat": ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
}


def base_config() -> ConfigDict:
    """Every key with its default. Defaults are the tiny CPU model."""
    c = ConfigDict()
    c.model = dict(
        vocab_size=320, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=0,
        d_ff=384, mlp="swiglu", norm="rmsnorm", use_bias=False, position="rope",
        max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
        compute_dtype="float32", attention="xla", remat="none", init_std=0.02,
    )
    c.data = dict(
        corpus="stdlib", tokenizer="byte", seq_len=256, heldout_fraction=0.02,
        max_train_bytes=0, cache_dir="",
    )
    c.optim = dict(
        lr=3e-3, min_lr_ratio=0.1, warmup_steps=50, decay_steps=0, b1=0.9, b2=0.95,
        eps=1e-8, weight_decay=0.1, decay_embeddings=False, decay_norms_and_biases=False,
        grad_clip=1.0, z_loss=0.0,
    )
    c.train = dict(
        steps=500, batch_size=16, micro_batches=1, seed=0, log_every=10,
        peak_flops=0.0, sample_tokens=200, sample_prompt="def ",
    )
    c.eval = dict(every_steps=100, batches=8, batch_size=16)
    c.checkpoint = dict(every_steps=100, keep=3)
    c.mesh = dict(data=-1, fsdp=1, tensor=1, rules=dict(DEFAULT_RULES))
    return c


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
        merge(config, _load_file(path))
    apply_overrides(config, list(overrides))
    validate(config)
    return config


def _load_file(path: str) -> ConfigDict:
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


def _require(ok: bool, key: str, value, expected: str) -> None:
    if not ok:
        raise UserError(f"config key '{key}' = {value!r}: {expected}")


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
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_heads={m.n_heads}")
    _require(m.position != "rope" or _head_dim(m) % 2 == 0, "model.head_dim", _head_dim(m),
             "RoPE needs an even head dimension")
    _require(c.data.seq_len <= m.max_seq_len, "data.seq_len", c.data.seq_len,
             f"must be <= model.max_seq_len={m.max_seq_len}")
    _require(0.0 < c.data.heldout_fraction < 1.0, "data.heldout_fraction", c.data.heldout_fraction,
             "expected a fraction in (0, 1)")
    t = c.train
    _require(t.steps > 0, "train.steps", t.steps, "expected a positive integer")
    _require(t.micro_batches > 0 and t.batch_size % t.micro_batches == 0, "train.micro_batches",
             t.micro_batches, f"must be positive and divide train.batch_size={t.batch_size}")
    _require(c.optim.lr > 0, "optim.lr", c.optim.lr, "expected a positive learning rate")
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


def _head_dim(m) -> int:
    return m.head_dim or m.d_model // m.n_heads


def rules_table(c: ConfigDict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The logical-axis rule table as the hashable sequence flax expects."""
    return tuple((name, tuple(axes) if axes else None) for name, axes in sorted(c.mesh.rules.items()))
