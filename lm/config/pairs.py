"""The `pairs` section: the preference data `lm dpo` and `lm reward` share."""

from __future__ import annotations

from lm.config.core import ON_BAD_RECORD, require
from lm.config.sft import TRUNCATION

# preference pairs {"prompt", "chosen", "rejected"[, "margin"]} in JSONL. init, epochs,
# truncation, on_bad_record, max_skipped_fraction as for sft; eval_pairs held-out pairs are
# scored at every eval; eval_answers: held-out conversations (chat JSONL) answered greedily by
# the initial and the tuned model at the end ('' = none)
DEFAULTS = dict(
    init="",
    data="",
    eval_data="",
    epochs=1.0,
    truncation="drop",
    on_bad_record="error",
    max_skipped_fraction=0.05,
    eval_pairs=256,
    eval_answers="",
    eval_examples=256,
    eval_max_new_tokens=64,
)

CHOICES = dict(truncation=TRUNCATION, on_bad_record=ON_BAD_RECORD)


def check(c) -> None:
    p = c.pairs
    for key in ("eval_examples", "eval_max_new_tokens", "eval_pairs"):
        require(p[key] >= 1, f"pairs.{key}", p[key], "expected a positive integer")
    require(p.epochs >= 0, "pairs.epochs", p.epochs, "expected >= 0 (0 = use train.steps)")
    require(
        0.0 <= p.max_skipped_fraction <= 1.0,
        "pairs.max_skipped_fraction",
        p.max_skipped_fraction,
        "expected a fraction in [0, 1]",
    )
