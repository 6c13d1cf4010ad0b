"""The `curate` config section: stage names and the value checks beyond types.

Kept free of datatrove so that a run can check its settings before any data work.
"""

from __future__ import annotations

from pathlib import Path

from lm.errors import UserError

FILTER_STAGES = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "word_list")
DEDUP_STAGES = ("exact_dedup", "near_dedup")


def n_gram_fracs(key: str, items) -> tuple[tuple[int, float], ...]:
    out = []
    for item in items:
        n, _, frac = item.partition(":")
        try:
            out.append((int(n), float(frac)))
        except ValueError:
            raise UserError(f"config key 'curate.gopher_repetition.{key}': '{item}' is not N:FRACTION, "
                            "e.g. '2:0.20'") from None
    return tuple(out)


def check_config(cfg) -> None:
    """Value checks beyond types; each error names the key."""
    def require(ok, key, value, expected):
        if not ok:
            raise UserError(f"config key 'curate.{key}' = {value!r}: {expected}")

    require(cfg.tasks >= 0, "tasks", cfg.tasks, "expected >= 0 (0 = automatic)")
    n = cfg.near_dedup
    for key in ("ngrams", "bands", "rows"):
        require(n[key] > 0, f"near_dedup.{key}", n[key], "expected a positive integer")
    require(0.0 <= cfg.language.threshold < 1.0, "language.threshold", cfg.language.threshold,
            "expected a score in [0, 1)")
    require(len(cfg.language.keep) > 0, "language.keep", cfg.language.keep,
            "expected language codes such as en,fr (or curate.language.enabled=false)")
    w = cfg.word_list
    require(not w.enabled or Path(w.path).is_file(), "word_list.path", w.path,
            "expected an existing file with one word per line when curate.word_list.enabled")
    require(w.max_hits >= 0, "word_list.max_hits", w.max_hits, "expected >= 0")
    for key in ("top_n_grams", "dup_n_grams"):
        n_gram_fracs(key, cfg.gopher_repetition[key])
