"""The config of a fine-tuning stage (`lm sft`, `lm dpo`, `lm reward`, `lm rl`, `lm distill`), which
starts from a trained model and keeps its shape: the stages' shared composition of config sections."""

from __future__ import annotations

from lm.config import Config, apply_overrides, base_config, freeze, load_file, merge, thaw, validate, with_values
from lm.config.finetune import DEFAULTS, LR_FRACTION, OVERRIDES
from lm.errors import UserError
from lm.train.registry import stage_entry


def finetune_config(start, path: str | None = None, overrides=(), stage: str = "sft", **keys) -> Config:
    """The config of a fine-tuning run: the schema, the fine-tuning defaults (lm.config.finetune),
    the model and sequence length of the run it starts from (`start`, its config), the stage's own
    defaults (its registry entry's), then `path` (only the keys its get_config() sets), `keys`
    (finetune keys, e.g. init, from the command line) and the overrides; validated. A finetune key
    the stage does not read (its entry's `reads`) set away from its default is an error."""
    entry = stage_entry(stage)
    c = base_config()
    merge(c, {"model": start.model.to_dict()})
    c.data.update(seq_len=start.data.seq_len, cache_dir=start.data.cache_dir)
    c.optim.lr = start.optim.lr * LR_FRACTION
    apply_overrides(c, [f"{k}={v}" for k, v in OVERRIDES.items()])
    for dotted, value in entry.defaults:
        section, _, key = dotted.partition(".")
        merge(c, {section: {key: value}})
    if path:
        merge(c, load_file(path))
    c.finetune.update({k: v for k, v in keys.items() if v is not None})
    apply_overrides(c, list(overrides))
    validate(c)
    _check_reads(c, entry)
    return freeze(c)


def _check_reads(c, entry) -> None:
    if not entry.reads:
        return
    defaults = DEFAULTS | {d.partition(".")[2]: v for d, v in entry.defaults if d.startswith("finetune.")}
    for key in DEFAULTS:
        if key not in entry.reads and c.finetune[key] != defaults[key]:
            raise UserError(
                f"config key 'finetune.{key}' = {c.finetune[key]!r}: `lm {entry.command}` does not read it "
                f"(it reads finetune.{', finetune.'.join(entry.reads)})"
            )


def continued_config(config, start, init: str, tokenizer: str, overrides=()) -> Config:
    """A pretraining config that continues `init` (train.init): the model section of the model it
    starts from (`start`, its config) with the command line's own `model.*` overrides on top (a
    long-context extension sets RoPE scaling and max_seq_len so), its tokenizer, everything else
    from `config`; validated."""
    c = thaw(with_values(config, {"model": start.model.to_dict(), "data.tokenizer": tokenizer, "train.init": init}))
    apply_overrides(c, [o for o in overrides if o.startswith("model.")])
    c.data.seq_len = min(c.data.seq_len, c.model.max_seq_len)
    c = freeze(c)
    validate(c)
    return c
