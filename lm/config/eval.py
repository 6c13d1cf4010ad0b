"""The `eval` section: held-out loss during training, and extra language-modelling sets."""

from __future__ import annotations

from lm.config.core import require
from lm.errors import UserError

# sets: ("NAME=PATH", ...) language-modelling sets (text, {"text"} JSONL, corpus, token shards)
# scored at every eval, at most set_tokens tokens each: eval/NAME/loss and eval/NAME/bits_per_byte
DEFAULTS = dict(every_steps=100, batches=8, batch_size=16, sets=(), set_tokens=65536)


def parse_sets(specs) -> list[tuple[str, str]]:
    """eval.sets entries 'NAME=PATH' -> [(name, path)] (lm.eval.during scores them)."""
    out = []
    for i, spec in enumerate(specs):
        name, eq, path = str(spec).partition("=")
        if not eq or not name or not path or "/" in name:
            raise UserError(
                f'eval.sets[{i}] = {spec!r}: expected NAME=PATH (a text file, {{"text"}} JSONL, '
                "corpus or token shard set)"
            )
        out.append((name, path))
    return out


def check(c) -> None:
    parse_sets(c.eval.sets)
    require(c.eval.set_tokens > 0, "eval.set_tokens", c.eval.set_tokens, "expected > 0")
