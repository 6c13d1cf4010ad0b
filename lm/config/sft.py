"""The `sft` section (`lm sft`), and `SftSettings`: how conversations become rows (lm.data.sft;
lm.data.preference reads it from the pairs section)."""

from __future__ import annotations

import dataclasses

from lm.config.core import ON_BAD_RECORD, require
from lm.errors import UserError

TRUNCATION = ("drop", "cut_prompt_left", "cut_response")
TRAIN_ON = ("all", "last")

# init is the run or export to start from; data / eval_data JSONL conversations (chat
# or instruction lines). epochs > 0 sets train.steps (0: train.steps as given). truncation of
# over-long examples: drop | cut_prompt_left | cut_response; train_on: all | last assistant
# turns; an example left with no assistant token is skipped, more than max_skipped_fraction of
# them stops the run. eval_examples held-out conversations are answered greedily at the end.
DEFAULTS = dict(
    init="",
    data="",
    eval_data="",
    epochs=3.0,
    truncation="drop",
    train_on="all",
    on_bad_record="error",
    max_skipped_fraction=0.05,
    eval_examples=256,
    eval_max_new_tokens=64,
)

CHOICES = dict(truncation=TRUNCATION, train_on=TRAIN_ON, on_bad_record=ON_BAD_RECORD)


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """Defaults are the sft section's: the pairs section has no train_on."""

    seq_len: int  # predictions per row: an example of n tokens fits when n - 1 <= seq_len
    truncation: str = DEFAULTS["truncation"]
    train_on: str = DEFAULTS["train_on"]
    on_bad_record: str = DEFAULTS["on_bad_record"]
    max_skipped_fraction: float = DEFAULTS["max_skipped_fraction"]  # of examples with an all-zero loss mask

    @classmethod
    def from_config(cls, section, seq_len: int) -> SftSettings:
        """From the sft or pairs section; seq_len is data.seq_len."""
        names = [f.name for f in dataclasses.fields(cls) if f.name in section]
        return cls(seq_len=seq_len, **{name: section[name] for name in names})

    def check(self) -> None:
        for key, choices in CHOICES.items():
            value = getattr(self, key)
            if value not in choices:
                raise UserError(f"sft {key}='{value}'; expected one of {', '.join(choices)}")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise UserError(f"sft seq_len={self.seq_len!r}; expected an integer >= 1")
        if not 0.0 <= self.max_skipped_fraction <= 1.0:
            raise UserError(f"sft max_skipped_fraction={self.max_skipped_fraction}; expected a fraction in [0, 1]")


def check(c) -> None:
    s = c.sft
    require(s.epochs >= 0, "sft.epochs", s.epochs, "expected >= 0 (0 = use train.steps)")
    require(
        0.0 <= s.max_skipped_fraction <= 1.0,
        "sft.max_skipped_fraction",
        s.max_skipped_fraction,
        "expected a fraction in [0, 1]",
    )
    for key in ("eval_examples", "eval_max_new_tokens"):
        require(s[key] >= 1, f"sft.{key}", s[key], "expected a positive integer")
