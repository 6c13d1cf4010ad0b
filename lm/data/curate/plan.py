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

from lm.data.curate import blocks
from lm.data.curate.read import BAD_RECORDS, InputFile
from lm.data.curate.settings import DEDUP_STAGES, n_gram_fracs

SHARD_PATTERN = "part-${rank}.jsonl.gz"


@dataclass
class Pass:
    name: str
    steps: list
    tasks: int


def _options(section, drop=("enabled",)) -> dict:
    return {k: v for k, v in section.items() if k not in drop}


def filter_blocks(cfg) -> list:
    """The enabled per-document filters, in pipeline order (cheap and selective first)."""
    out = []
    if cfg.language.enabled:
        out.append(blocks.LanguageId(list(cfg.language.keep), cfg.language.threshold))
    if cfg.gopher_repetition.enabled:
        g = cfg.gopher_repetition
        out.append(
            blocks.GopherRepetition(
                **_options(g, ("enabled", "top_n_grams", "dup_n_grams")),
                top_n_grams=n_gram_fracs("top_n_grams", g.top_n_grams),
                dup_n_grams=n_gram_fracs("dup_n_grams", g.dup_n_grams),
            )
        )
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
    tail.append(
        JsonlWriter(str(final_dir), output_filename=SHARD_PATTERN, compression="gzip", adapter=blocks.final_record)
    )
    return tail


def _shard_writer(folder: Path) -> JsonlWriter:
    return JsonlWriter(str(folder), output_filename="${rank}.jsonl", compression=None)


def build_passes(cfg, files: list[InputFile], tasks: int, work: Path, progress: bool) -> list[Pass]:
    """All passes for this config; `work` holds intermediates, `work/final` the output shards."""
    final = work / "final"
    dedups = [name for name in DEDUP_STAGES if cfg[name].enabled]
    reader = blocks.InputReader(files, cfg.text_key, cfg.on_bad_record, progress, str(work / BAD_RECORDS))
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
        Pass(
            "exact_dedup: hash", [blocks.ShardReader(str(source)), ExactDedupSignature(str(sigs), config=config)], tasks
        ),
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
