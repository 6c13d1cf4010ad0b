"""The `curate` section (`lm curate`, and data.curate=true): every stage on, with the thresholds
published with each rule set (Gopher: Rae et al. 2021; C4: Raffel et al. 2020; FineWeb: Penedo et
al. 2024). These suit web prose; for source code turn the prose rules off (see
lm/data/curate/__init__.py). Free of datatrove, so a run checks its settings before any data work.
"""

from __future__ import annotations

from pathlib import Path

from lm.config.core import ON_BAD_RECORD, require
from lm.errors import UserError

FILTER_STAGES = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "word_list")
DEDUP_STAGES = ("exact_dedup", "near_dedup")

DEFAULTS = dict(
    on_bad_record="error",  # "error": stop, naming file and line; "skip": count and skip
    text_key="text",  # the text field of .jsonl / .parquet inputs
    tasks=0,  # shards of work (and output files); 0 = one per 8 MB of input
    exact_dedup=dict(enabled=True),
    near_dedup=dict(enabled=True, ngrams=5, bands=14, rows=8),  # MinHash LSH, 112 hashes
    language=dict(enabled=True, keep=("en",), threshold=0.65),
    gopher_repetition=dict(
        enabled=True,
        dup_line_frac=0.3,
        dup_para_frac=0.3,
        dup_line_char_frac=0.2,
        dup_para_char_frac=0.2,
        top_n_grams=("2:0.20", "3:0.18", "4:0.16"),
        dup_n_grams=("5:0.15", "6:0.14", "7:0.13", "8:0.12", "9:0.11", "10:0.10"),
    ),
    gopher_quality=dict(
        enabled=True,
        min_doc_words=50,
        max_doc_words=100000,
        min_avg_word_length=3,
        max_avg_word_length=10,
        max_symbol_word_ratio=0.1,
        max_bullet_lines_ratio=0.9,
        max_ellipsis_lines_ratio=0.3,
        max_non_alpha_words_ratio=0.8,
        min_stop_words=2,
    ),
    c4=dict(
        enabled=True,
        split_paragraph=True,
        remove_citations=True,
        filter_no_terminal_punct=True,
        min_num_sentences=5,
        min_words_per_line=3,
        max_word_length=1000,
        filter_lorem_ipsum=True,
        filter_javascript=True,
        filter_curly_bracket=True,
        filter_policy=True,
    ),
    fineweb=dict(
        enabled=True,
        line_punct_thr=0.12,
        line_punct_exclude_zero=False,
        short_line_thr=0.67,
        short_line_length=30,
        char_duplicates_ratio=0.01,
        new_line_ratio=0.3,
    ),
    word_list=dict(enabled=False, path="", max_hits=0),  # a local file, one word per line
    pii=dict(enabled=True, emails=True, ips=True, phones=True),
)

CHOICES = dict(on_bad_record=ON_BAD_RECORD)


def n_gram_fracs(key: str, items) -> tuple[tuple[int, float], ...]:
    out = []
    for item in items:
        n, _, frac = item.partition(":")
        try:
            out.append((int(n), float(frac)))
        except ValueError:
            raise UserError(
                f"config key 'curate.gopher_repetition.{key}': '{item}' is not N:FRACTION, e.g. '2:0.20'"
            ) from None
    return tuple(out)


def check(c) -> None:
    """At load only the choices: a run that does not curate may hold any values (check_config runs
    before curating)."""


def check_config(cfg) -> None:
    """Value checks beyond types, before any curation work; `cfg` is the curate section."""
    require(cfg.tasks >= 0, "curate.tasks", cfg.tasks, "expected >= 0 (0 = automatic)")
    n = cfg.near_dedup
    for key in ("ngrams", "bands", "rows"):
        require(n[key] > 0, f"curate.near_dedup.{key}", n[key], "expected a positive integer")
    require(
        0.0 <= cfg.language.threshold < 1.0,
        "curate.language.threshold",
        cfg.language.threshold,
        "expected a score in [0, 1)",
    )
    require(
        len(cfg.language.keep) > 0,
        "curate.language.keep",
        cfg.language.keep,
        "expected language codes such as en,fr (or curate.language.enabled=false)",
    )
    w = cfg.word_list
    require(
        not w.enabled or Path(w.path).is_file(),
        "curate.word_list.path",
        w.path,
        "expected an existing file with one word per line when curate.word_list.enabled",
    )
    require(w.max_hits >= 0, "curate.word_list.max_hits", w.max_hits, "expected >= 0")
    for key in ("top_n_grams", "dup_n_grams"):
        n_gram_fracs(key, cfg.gopher_repetition[key])
