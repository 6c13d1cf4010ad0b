"""The data config -> train / held-out sources for the loader, in one call.

    raw corpus -> (curate) -> tokenizer (existing, or trained here) -> token shards -> Source

A source is either a corpus spec ('stdlib', a directory or a glob of plain or
JSONL files), optionally curated (`data.curate`, settings in the `curate` section)
and tokenized into the cache, or a directory written by `lm tokenize` (used as it
is). Every cached step is named or fingerprinted by its inputs, so a second run
reuses it and any change redoes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from lm.config import data_sources
from lm.data.corpus import resolve_corpus
from lm.data.pipeline import Pieces, Source, check_weights
from lm.data.shards import SPLITS, input_key, open_shards, tokenize_corpus, train_documents
from lm.data.tokenizer import Tokenizer, load_tokenizer
from lm.errors import UserError

_CHUNK = 1 << 24  # tokens per pass when counting, to bound memory
_ENTROPY_TOKENS = 1 << 26  # the unigram baseline is estimated from at most this many tokens per source


@dataclasses.dataclass
class PretrainData:
    train: list[Source]
    heldout: list[Source]
    tokenizer: Tokenizer
    stats: dict


def is_shard_dir(spec: str) -> bool:
    return all((Path(spec) / s / "manifest.json").is_file() for s in SPLITS)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def resolve_tokenizer(name: str, corpus: str | None, heldout_fraction: float, cache: Path) -> Tokenizer:
    """'byte', a sentencepiece .model path, or 'spm:VOCAB': a BPE trained here on the
    train split of `corpus` (cached by its files and the vocabulary size)."""
    if not name.startswith("spm:"):
        return load_tokenizer(name)
    try:
        vocab = int(name[len("spm:"):])
    except ValueError:
        raise UserError(f"data.tokenizer: '{name}': expected spm:VOCAB_SIZE, e.g. spm:8192") from None
    if corpus is None:
        raise UserError(f"data.tokenizer: '{name}' trains on a corpus, but data.sources holds only "
                        "tokenized directories; give their tokenizer's .model instead")
    root, files = resolve_corpus(corpus)
    key = _digest([str(root.resolve()), [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
                   heldout_fraction, vocab])
    prefix = cache / f"tokenizer-spm{vocab}-{key}"
    if Path(str(prefix) + ".model").is_file():
        return load_tokenizer(str(prefix) + ".model")
    print(f"training a {vocab}-piece sentencepiece tokenizer on '{corpus}' -> {prefix}.model")
    return train_corpus_tokenizer(corpus, heldout_fraction, prefix, vocab)


def _workers(d) -> int:
    return d.workers or os.cpu_count() or 1


def curated_corpus(corpus: str, d, curate_cfg, cache: Path, progress: bool) -> str:
    """Curates a corpus into the cache (curate itself skips work already done) and
    returns the corpus spec of its output shards."""
    from lm.data.curate import curate  # lazy: needs the curation extras

    if curate_cfg is None:
        raise UserError("data.curate=true needs the config's curate section")
    out = cache / f"curated-{_digest(corpus)}"
    curate(corpus, out, curate_cfg, workers=_workers(d), progress=progress)
    if not list(out.glob("*.jsonl.gz")):
        raise UserError(f"data.curate: curation kept no documents of '{corpus}'; see {out / 'report.json'}")
    return str(out / "*.jsonl.gz")


def corpus_shards(corpus: str, d, tok: Tokenizer, tokenizer_name: str, cache: Path, progress: bool) -> Path:
    """Tokenizes a corpus into the cache (a no-op when done before); returns the shard directory."""
    resolved = resolve_corpus(corpus)
    key = input_key(*resolved, tok, d.heldout_fraction, d.max_train_bytes)
    out = cache / f"shards-{tok.name}-{key[:16]}"
    tokenize_corpus(corpus, out, tokenizer_name, d.heldout_fraction, max_train_bytes=d.max_train_bytes,
                    workers=d.workers, progress=progress, resolved=resolved)
    return out


def prepare_pretrain_data(d, cache: Path, vocab_size: int | None = None, progress: bool = True,
                          curate_cfg=None) -> PretrainData:
    """Sources of the `data` config section, curated if asked, tokenized (or reused) and opened.

    `vocab_size` is the model's: every token id must be below it. `curate_cfg` is the
    config's `curate` section, used when `d.curate` is set.
    """
    cache = Path(cache)
    specs = data_sources(d)
    corpora = {spec: (curated_corpus(spec, d, curate_cfg, cache, progress) if d.curate else spec)
               for spec, _ in specs if not is_shard_dir(spec)}
    tok = resolve_tokenizer(d.tokenizer, next(iter(corpora.values()), None), d.heldout_fraction, cache)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise UserError(f"model.vocab_size={vocab_size} is smaller than the '{d.tokenizer}' tokenizer's "
                        f"{tok.vocab_size} ids")
    tokenizer_name = str(tok.path) if hasattr(tok, "path") else d.tokenizer
    train, heldout = [], []
    for spec, weight in specs:
        directory = (corpus_shards(corpora[spec], d, tok, tokenizer_name, cache, progress) if spec in corpora
                     else Path(spec))
        train.append(Source(spec, open_shards(directory / "train", tok, vocab_size), weight))
        heldout.append(Source(spec, open_shards(directory / "heldout", tok, vocab_size), weight))
    check_weights(train)
    return PretrainData(train, heldout, tok, data_stats(train, heldout, tok.vocab_size, d.seq_len))


def data_stats(train: list[Source], heldout: list[Source], vocab_size: int, seq_len: int) -> dict:
    """Sizes per source, documents split into several rows, and the unigram baseline."""
    per_source = []
    for tr, ho in zip(train, heldout):
        mt, mh = tr.shards.manifest, ho.shards.manifest
        per_source.append({
            "source": tr.name, "weight": tr.weight, "train_docs": mt["n_docs"], "train_tokens": mt["n_tokens"],
            "train_bytes": mt["n_bytes"], "heldout_docs": mh["n_docs"], "heldout_tokens": mh["n_tokens"],
            "split_docs": Pieces(tr.shards, seq_len).stats()["split_docs"],
            **mt["skipped"],  # counted over the whole input, the same in both manifests
        })
    totals = {k: sum(s[k] for s in per_source) for k in ("train_docs", "train_tokens", "train_bytes",
                                                         "heldout_docs", "heldout_tokens", "split_docs")}
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


def train_corpus_tokenizer(corpus: str, heldout_fraction: float, out_prefix: Path, vocab_size: int,
                           max_bytes: int = 50_000_000):
    """Trains a sentencepiece BPE on the *train* split of a corpus (held-out documents never seen)."""
    from lm.data.spm import train_sentencepiece  # lazy: needs sentencepiece

    docs = train_documents(corpus, heldout_fraction)
    return train_sentencepiece(docs, out_prefix, vocab_size, max_bytes=max_bytes)
