"""The data config -> train / held-out sources for the loader, in one call.

    raw corpus -> (curate) -> tokenizer (existing, or trained here) -> token shards -> Source

A source is either a corpus spec ('stdlib', a directory or a glob of plain or
JSONL files), optionally curated (`data.curate`, settings in the `curate` section)
and tokenized into the cache, or a directory written by `lm tokenize` (used as it
is). The cache (`lm.data.cache`, shared by all runs) names each entry by a
fingerprint of what shapes it, so a second run reuses it and a change redoes
exactly the steps it affects (an entry that no longer matches its manifest is built again):

  curated-<key>          input files (paths, sizes, mtimes), the `curate` section, task count
  tokenizer-spm<N>-<key> the (curated) corpus files, heldout_fraction, N, training settings;
                         holds tokenizer-spm<N>-<key>.model and .vocab
  shards-<tok>-<key>     the (curated) corpus files, the tokenizer's fingerprint,
                         heldout_fraction, max_train_bytes
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
from pathlib import Path

import numpy as np

from lm.config import data_sources
from lm.data.cache import cached_dir, data_cache_dir
from lm.data.checks import source_label, spm_vocab
from lm.data.corpus import resolve_corpus
from lm.data.pipeline import Pieces, Source, check_weights
from lm.data.shards import input_key, is_shard_dir, open_shards, tokenize_corpus, train_documents
from lm.data.tokenizer import Tokenizer, load_tokenizer
from lm.errors import UserError

_CHUNK = 1 << 24  # tokens per pass when counting, to bound memory
_ENTROPY_TOKENS = 1 << 26  # the unigram baseline is estimated from at most this many tokens per source
SPM_MAX_BYTES = 50_000_000  # a trained tokenizer sees at most this much of the train split
_SPM_KEY_VERSION = 1  # bump when training a tokenizer changes for the same inputs


@dataclasses.dataclass
class PretrainData:
    train: list[Source]
    heldout: list[Source]
    tokenizer: Tokenizer
    stats: dict


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _files_key(corpus: str) -> list:
    root, files = resolve_corpus(corpus)
    return [str(root.resolve()), [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def resolve_tokenizer(name: str, corpus: str | None, heldout_fraction: float, cache: Path) -> Tokenizer:
    """'byte', a sentencepiece .model path, or 'spm:VOCAB': a BPE trained here on the train split
    of `corpus`, cached by its files (paths, sizes, mtimes), the split, the vocabulary size, the
    training settings and the sentencepiece version."""
    if not name.startswith("spm:"):
        return load_tokenizer(name)
    vocab = spm_vocab(name)
    if corpus is None:
        raise UserError(
            f"data.tokenizer: '{name}' trains on a corpus, but data.sources holds only "
            "tokenized directories; give their tokenizer's .model instead"
        )
    key = _digest(
        {
            "version": _SPM_KEY_VERSION,
            "sentencepiece": importlib.metadata.version("sentencepiece"),
            "corpus": _files_key(corpus),
            "heldout_fraction": heldout_fraction,
            "vocab": vocab,
            "max_bytes": SPM_MAX_BYTES,
        }
    )
    name = f"tokenizer-spm{vocab}-{key}"

    def train(staging: Path) -> None:
        print(f"training a {vocab}-piece sentencepiece tokenizer on '{corpus}' -> {cache / name}")
        train_corpus_tokenizer(corpus, heldout_fraction, staging / name, vocab)

    out, built = cached_dir(cache, name, train)
    model = out / f"{name}.model"  # the entry's name as the stem: it names the tokenizer (and shard entries)
    if not built:
        print(f"tokenizer: reusing {model}")
    return load_tokenizer(str(model))


def _workers(d) -> int:
    return d.workers or os.cpu_count() or 1


def curated_corpus(corpus: str, d, curate_cfg, cache: Path, progress: bool, label: str = "data.corpus") -> str:
    """Curates a corpus into the cache, or reuses the entry of the same input files and `curate`
    settings; returns the corpus spec of its output shards."""
    from lm.data.curate import REPORT, curate, curate_key

    if curate_cfg is None:
        raise UserError("data.curate=true needs the config's curate section")
    name = f"curated-{curate_key([corpus], curate_cfg, [label])}"
    out, built = cached_dir(
        cache,
        name,
        lambda staging: curate(corpus, staging, curate_cfg, workers=_workers(d), progress=progress, labels=[label]),
    )
    report = json.loads((out / REPORT).read_text())
    if not built:
        print(f"curated corpus: reusing {out} (kept {report['kept']['docs']:,} of {report['in']['docs']:,} documents)")
    if not report["shards"]:
        raise UserError(f"data.curate: curation kept no documents of {label} = '{corpus}'; see {out / REPORT}")
    return str(out / "*.jsonl.gz")


def corpus_shards(
    corpus: str, d, tok: Tokenizer, tokenizer_name: str, cache: Path, progress: bool, label: str = "data.corpus"
) -> Path:
    """Tokenizes a corpus into the cache, or reuses the entry of the same files, tokenizer and
    split settings; returns the shard directory."""
    resolved = resolve_corpus(corpus, label)
    key = input_key(*resolved, tok, d.heldout_fraction, d.max_train_bytes)
    out, built = cached_dir(
        cache,
        f"shards-{tok.name}-{key[:16]}",
        lambda staging: tokenize_corpus(
            corpus,
            staging,
            tokenizer_name,
            d.heldout_fraction,
            max_train_bytes=d.max_train_bytes,
            workers=d.workers,
            progress=progress,
            resolved=resolved,
        ),
    )
    if not built:
        print(f"token shards: reusing {out}")
    return out


def prepare_pretrain_data(
    d, cache: Path | None = None, vocab_size: int | None = None, progress: bool = True, curate_cfg=None
) -> PretrainData:
    """Sources of the `data` config section, curated if asked, tokenized (or reused) and opened.

    `cache` is the cache root (None: `data_cache_dir(d)`, shared by runs). `vocab_size` is the
    model's: every token id must be below it. `curate_cfg` is the config's `curate` section,
    used when `d.curate` is set.
    """
    cache = Path(cache) if cache is not None else data_cache_dir(d)
    specs = data_sources(d)
    corpora = {
        spec: (curated_corpus(spec, d, curate_cfg, cache, progress, source_label(d, i)) if d.curate else spec)
        for i, (spec, _) in enumerate(specs)
        if not is_shard_dir(spec)
    }
    tok = resolve_tokenizer(d.tokenizer, next(iter(corpora.values()), None), d.heldout_fraction, cache)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise UserError(
            f"model.vocab_size={vocab_size} is smaller than the '{d.tokenizer}' tokenizer's {tok.vocab_size} ids"
        )
    tokenizer_name = str(tok.path) if hasattr(tok, "path") else d.tokenizer
    train, heldout = [], []
    for i, (spec, weight) in enumerate(specs):
        directory = (
            corpus_shards(corpora[spec], d, tok, tokenizer_name, cache, progress, source_label(d, i))
            if spec in corpora
            else Path(spec)
        )
        train.append(Source(spec, open_shards(directory / "train", tok, vocab_size), weight))
        heldout.append(Source(spec, open_shards(directory / "heldout", tok, vocab_size), weight))
    check_weights(train)
    return PretrainData(train, heldout, tok, data_stats(train, heldout, tok.vocab_size, d.seq_len))


def data_stats(train: list[Source], heldout: list[Source], vocab_size: int, seq_len: int) -> dict:
    """Sizes per source, documents split into several rows, and the unigram baseline."""
    per_source = []
    for tr, ho in zip(train, heldout):
        mt, mh = tr.shards.manifest, ho.shards.manifest
        per_source.append(
            {
                "source": tr.name,
                "weight": tr.weight,
                "train_docs": mt["n_docs"],
                "train_tokens": mt["n_tokens"],
                "train_bytes": mt["n_bytes"],
                "heldout_docs": mh["n_docs"],
                "heldout_tokens": mh["n_tokens"],
                "split_docs": Pieces(tr.shards, seq_len).stats()["split_docs"],
                **mt["skipped"],  # counted over the whole input, the same in both manifests
            }
        )
    totals = {
        k: sum(s[k] for s in per_source)
        for k in ("train_docs", "train_tokens", "train_bytes", "heldout_docs", "heldout_tokens", "split_docs")
    }
    return totals | {"unigram_entropy_nats": mixture_entropy_nats(train, vocab_size), "sources": per_source}


def token_counts(shards, vocab_size: int, limit: int = _ENTROPY_TOKENS) -> np.ndarray:
    counts, seen = np.zeros(vocab_size, np.int64), 0
    for tokens in shards.tokens:
        for i in range(0, len(tokens), _CHUNK):
            if seen >= limit:
                return counts
            chunk = tokens[i : i + min(_CHUNK, limit - seen)]
            counts += np.bincount(chunk, minlength=vocab_size)
            seen += len(chunk)
    return counts


def unigram_entropy_nats(counts: np.ndarray) -> float:
    """Entropy of a token frequency distribution: the loss of a model that ignores context."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log(p)).sum())


def mixture_entropy_nats(sources: list[Source], vocab_size: int) -> float:
    """The unigram entropy of the training mixture: each source's distribution, weighted."""
    total = sum(s.weight for s in sources)
    mix = np.zeros(vocab_size)
    for s in sources:
        counts = token_counts(s.shards, vocab_size)
        mix += (s.weight / total) * counts / max(counts.sum(), 1)
    return unigram_entropy_nats(mix)


def describe(stats: dict) -> str:
    """One line for logs: sizes, split documents and the unigram baseline a model must beat."""
    h = stats["unigram_entropy_nats"]
    return (
        f"train {stats['train_tokens']:,} tokens ({stats['train_docs']:,} docs, {stats['split_docs']:,} split "
        f"over several rows), held-out {stats['heldout_tokens']:,} tokens ({stats['heldout_docs']:,} docs), "
        f"{len(stats['sources'])} source(s), unigram entropy {h:.3f} nats ({h / math.log(2):.3f} bits)"
    )


def train_corpus_tokenizer(
    corpus: str, heldout_fraction: float, out_prefix: Path, vocab_size: int, max_bytes: int = SPM_MAX_BYTES
):
    """Trains a sentencepiece BPE on the *train* split of a corpus (held-out documents never seen)."""
    from lm.data.spm import train_sentencepiece  # lazy: needs sentencepiece

    docs = train_documents(corpus, heldout_fraction)
    return train_sentencepiece(docs, out_prefix, vocab_size, max_bytes=max_bytes)
