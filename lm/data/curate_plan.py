"""The curation pipeline as datatrove passes, built from the `curate` config section.

Passes run one after another; each is a list of blocks run by an executor over
`tasks` shards (the dedup bookkeeping passes use their own task counts):

  filter   read inputs -> language id -> Gopher repetition -> Gopher quality -> C4
           -> FineWeb -> word list                          -> work/filtered/<rank>.jsonl
  exact    content-hash signatures; find duplicates (1 task); drop them
  near     MinHash signatures; LSH buckets (one task per band); clusters (1 task); drop
  The last pass that drops documents also redacts PII and writes the output shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from datatrove.pipeline.dedup import ExactDedupSignature, ExactFindDedups
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)
from datatrove.pipeline.writers import JsonlWriter

from lm.data import curate_blocks as blocks
from lm.data.curate_read import InputFile
from lm.errors import UserError

FILTER_STAGES = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "word_list")
DEDUP_STAGES = ("exact_dedup", "near_dedup")
SHARD_PATTERN = "part-${rank}.jsonl.gz"


@dataclass
class Pass:
    name: str
    steps: list
    tasks: int


def _n_gram_fracs(key: str, items) -> tuple[tuple[int, float], ...]:
    out = []
    for item in items:
        n, _, frac = item.partition(":")
        try:
            out.append((int(n), float(frac)))
        except ValueError:
            raise UserError(f"config key 'curate.gopher_repetition.{key}': '{item}' is not N:FRACTION, "
                            "e.g. '2:0.20'") from None
    return tuple(out)


def _options(section, drop=("enabled",)) -> dict:
    return {k: v for k, v in section.items() if k not in drop}


def filter_blocks(cfg) -> list:
    """The enabled per-document filters, in pipeline order (cheap and selective first)."""
    out = []
    if cfg.language.enabled:
        out.append(blocks.LanguageId(list(cfg.language.keep), cfg.language.threshold))
    if cfg.gopher_repetition.enabled:
        g = cfg.gopher_repetition
        out.append(blocks.GopherRepetition(
            **_options(g, ("enabled", "top_n_grams", "dup_n_grams")),
            top_n_grams=_n_gram_fracs("top_n_grams", g.top_n_grams),
            dup_n_grams=_n_gram_fracs("dup_n_grams", g.dup_n_grams)))
    if cfg.gopher_quality.enabled:
        out.append(blocks.GopherQuality(**_options(cfg.gopher_quality)))
    if cfg.c4.enabled:
        out.append(blocks.C4Quality(**_options(cfg.c4)))
    if cfg.fineweb.enabled:
        out.append(blocks.FineWebQuality(**_options(cfg.fineweb)))
    if cfg.word_list.enabled:
        out.append(blocks.WordList(cfg.word_list.path, cfg.word_list.max_hits))
    return out


def _final_tail(cfg, final_dir: Path) -> list:
    tail = []
    if cfg.pii.enabled:
        tail.append(blocks.PIIRedactor(cfg.pii.emails, cfg.pii.ips, cfg.pii.phones))
    tail.append(blocks.Tally("kept"))
    tail.append(JsonlWriter(str(final_dir), output_filename=SHARD_PATTERN, compression="gzip",
                            adapter=blocks.final_record))
    return tail


def _shard_writer(folder: Path) -> JsonlWriter:
    return JsonlWriter(str(folder), output_filename="${rank}.jsonl", compression=None)


def build_passes(cfg, files: list[InputFile], tasks: int, work: Path, progress: bool) -> list[Pass]:
    """All passes for this config; `work` holds intermediates, `work/final` the output shards."""
    final = work / "final"
    dedups = [name for name in DEDUP_STAGES if cfg[name].enabled]
    reader = blocks.InputReader(files, cfg.text_key, cfg.on_bad_record, progress)
    head = [reader, *filter_blocks(cfg)]
    if not dedups:
        return [Pass("filter", head + _final_tail(cfg, final), tasks)]
    passes = [Pass("filter", head + [_shard_writer(work / "filtered")], tasks)]
    source = work / "filtered"
    for i, name in enumerate(dedups):
        last = i == len(dedups) - 1
        dedup_passes, drop_block = (_exact_passes if name == "exact_dedup" else _near_passes)(cfg, source, work, tasks)
        passes += dedup_passes
        tail = _final_tail(cfg, final) if last else [_shard_writer(work / name)]
        passes.append(Pass(f"{name}: drop", [blocks.ShardReader(str(source)), drop_block, *tail], tasks))
        source = work / name
    return passes


def _exact_passes(cfg, source: Path, work: Path, tasks: int):
    config = ExactDedupConfig(content_getter=blocks.text_of)
    sigs, dups = work / "exact_sigs", work / "exact_dups"
    return [
        Pass("exact_dedup: hash", [blocks.ShardReader(str(source)), ExactDedupSignature(str(sigs), config=config)], tasks),
        Pass("exact_dedup: find", [ExactFindDedups(str(sigs), str(dups), config=config)], 1),
    ], blocks.ExactDuplicates(str(dups), config=config)


def _near_passes(cfg, source: Path, work: Path, tasks: int):
    n = cfg.near_dedup
    config = MinhashConfig(n_grams=n.ngrams, num_buckets=n.bands, hashes_per_bucket=n.rows)
    sigs, buckets, clusters = work / "minhash_sigs", work / "minhash_buckets", work / "minhash_clusters"
    signatures = MinhashDedupSignature(str(sigs), config=config, language=blocks.SimplifiedTextWords())
    return [
        Pass("near_dedup: minhash", [blocks.ShardReader(str(source)), signatures], tasks),
        Pass("near_dedup: buckets", [MinhashDedupBuckets(str(sigs), str(buckets), config=config)], n.bands),
        Pass("near_dedup: clusters", [MinhashDedupCluster(str(buckets), str(clusters), config=config)], 1),
    ], blocks.NearDuplicates(str(clusters))


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
        _n_gram_fracs(key, cfg.gopher_repetition[key])
