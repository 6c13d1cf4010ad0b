"""The `data` section: what pretraining reads and how it is tokenized and cached."""

from __future__ import annotations

import pathlib

from lm.config.core import require
from lm.errors import UserError

# sources: ("SPEC:WEIGHT", ...) mixed by weight; SPEC is a corpus ('stdlib', dir, glob) or an
# `lm tokenize` output dir; empty = data.corpus alone. tokenizer: 'byte', a .model, or 'spm:VOCAB'
# (trained on the first corpus). curate: run each corpus through `curate` (its section) first.
# workers: processes for curating and tokenizing (0 = all cores). cache_dir: prepared data shared
# by runs ('' = $LM_CACHE_DIR, else $XDG_CACHE_HOME/lm or ~/.cache/lm)
DEFAULTS = dict(
    corpus="stdlib",
    sources=(),
    tokenizer="byte",
    seq_len=256,
    heldout_fraction=0.02,
    max_train_bytes=0,
    cache_dir="",
    curate=False,
    workers=0,
)


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
                raise UserError(
                    f"data.sources[{i}] = {entry!r}: the weight after ':' must be a number (SPEC or SPEC:WEIGHT)"
                ) from None
            out.append((entry, 1.0))  # the ':' belongs to the path
    return out


def _check_sources(d) -> None:
    """Each weight >= 0 and finite; together they must sum to a positive number."""
    if not d.sources:
        return
    parsed = data_sources(d)
    for i, (spec, weight) in enumerate(parsed):
        require(bool(spec), f"data.sources[{i}]", d.sources[i], "expected SPEC or SPEC:WEIGHT")
        require(
            0 <= weight < float("inf"),
            f"data.sources[{i}]",
            d.sources[i],
            "expected a finite weight >= 0 after the last ':'",
        )
    require(sum(w for _, w in parsed) > 0, "data.sources", d.sources, "the weights must sum to a positive number")


def check(c) -> None:
    d = c.data
    require(
        d.seq_len <= c.model.max_seq_len,
        "data.seq_len",
        d.seq_len,
        f"must be <= model.max_seq_len={c.model.max_seq_len}",
    )
    _check_sources(d)
    require(d.workers >= 0, "data.workers", d.workers, "expected >= 0 (0 = all cores)")
    require(
        0.0 < d.heldout_fraction < 1.0, "data.heldout_fraction", d.heldout_fraction, "expected a fraction in (0, 1)"
    )
