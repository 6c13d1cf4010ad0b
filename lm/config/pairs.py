"""The `pairs` section: what `lm dpo` and `lm reward` share beyond the finetune section."""

from __future__ import annotations

from lm.config.core import require

# preference pairs {"prompt", "chosen", "rejected"[, "margin"]} in JSONL (finetune.data,
# finetune.eval_data); eval_pairs held-out pairs are scored at every eval
DEFAULTS = dict(eval_pairs=256)


def check(c) -> None:
    require(c.pairs.eval_pairs >= 1, "pairs.eval_pairs", c.pairs.eval_pairs, "expected a positive integer")
