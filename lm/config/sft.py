"""`SftSettings`: how conversations (lm.data.sft) and preference pairs (lm.data.preference) become
rows, read from the `finetune` section."""

from __future__ import annotations

import dataclasses

from lm.config.finetune import CHOICES, DEFAULTS
from lm.errors import UserError


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """Defaults are the finetune section's."""

    seq_len: int  # predictions per row: an example of n tokens fits when n - 1 <= seq_len
    truncation: str = DEFAULTS["truncation"]
    train_on: str = DEFAULTS["train_on"]
    on_bad_record: str = DEFAULTS["on_bad_record"]
    max_skipped_fraction: float = DEFAULTS["max_skipped_fraction"]  # of examples with an all-zero loss mask

    @classmethod
    def from_config(cls, section, seq_len: int) -> SftSettings:
        """From the finetune section; seq_len is data.seq_len."""
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
