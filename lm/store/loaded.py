"""What every loader returns: a model's config, params, tokenizer and where they came from."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Loaded:
    config: object  # the training config (a frozen lm.config.Config)
    params: dict  # numpy arrays, or lazy leaves that read their part on demand (lm.store.hf.reader)
    tokenizer: object
    source: str  # what was loaded, for messages
