"""Corpus spec -> cached train / held-out token files, ready for the pipeline.

The cache directory is named by a hash of everything that determines its
content (corpus spec, file list with sizes and mtimes, tokenizer fingerprint,
split fraction, byte cap), so a second run reuses it and any change rebuilds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from lm.data.corpus import resolve_corpus, split_files
from lm.data.tokenizer import Tokenizer, load_tokenizer
from lm.data.tokens import read_token_file, write_json, write_token_file
from lm.errors import UserError

CACHE_VERSION = 1  # bump when the preparation logic changes what it writes
_CHUNK = 1 << 24  # tokens per pass when counting, to bound memory


@dataclasses.dataclass
class PretrainData:
    train_tokens: np.ndarray  # np.memmap of ids, documents separated by EOS
    heldout_tokens: np.ndarray
    tokenizer: Tokenizer
    stats: dict
    path: Path  # the cache directory holding the token files


def unigram_entropy_nats(tokens, vocab_size: int) -> float:
    """Entropy of the token frequency distribution: the loss of a model that ignores context."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(0, len(tokens), _CHUNK):
        counts += np.bincount(tokens[i : i + _CHUNK], minlength=vocab_size)
    p = counts[counts > 0] / max(counts.sum(), 1)
    return float(-(p * np.log(p)).sum())


def _cap_bytes(files: list[Path], sizes: dict, max_bytes: int) -> list[Path]:
    """The longest prefix of whole files within max_bytes (at least one file); 0 = no cap."""
    if max_bytes <= 0:
        return files
    kept, total = [], 0
    for p in files:
        if kept and total + sizes[p] > max_bytes:
            break
        kept.append(p)
        total += sizes[p]
    return kept


def _cache_key(corpus, root, files, stats, tokenizer, heldout_fraction, max_bytes) -> str:
    inputs = {
        "version": CACHE_VERSION,
        "corpus": corpus,
        "root": str(root.resolve()),
        "files": [[p.relative_to(root).as_posix(), stats[p].st_size, stats[p].st_mtime_ns] for p in files],
        "tokenizer": tokenizer.fingerprint(),
        "heldout_fraction": heldout_fraction,
        "max_bytes": max_bytes,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _build(out: Path, corpus, root, files, sizes, tokenizer, heldout_fraction, max_bytes) -> dict:
    nonempty = [p for p in files if sizes[p] > 0]  # an empty file is no document
    train, heldout = split_files(root, nonempty, heldout_fraction)
    train = _cap_bytes(train, sizes, max_bytes)
    # Raw bytes, no decoding: the tokenizer sees exactly what is on disk.
    read_all = lambda ps: (p.read_bytes() for p in ps)  # noqa: E731
    train_meta = write_token_file(read_all(train), tokenizer, out / "train.bin")
    heldout_meta = write_token_file(read_all(heldout), tokenizer, out / "heldout.bin")
    train_tokens = read_token_file(out / "train.bin", tokenizer)
    stats = {
        "n_train_files": len(train),
        "n_heldout_files": len(heldout),
        "n_empty_files": len(files) - len(nonempty),
        "train_bytes": train_meta["n_bytes"],
        "heldout_bytes": heldout_meta["n_bytes"],
        "train_tokens": train_meta["n_tokens"],
        "heldout_tokens": heldout_meta["n_tokens"],
        "unigram_entropy_nats": unigram_entropy_nats(train_tokens, tokenizer.vocab_size),
    }
    # Written last: the manifest's presence marks a complete cache entry.
    write_json(out / "manifest.json", {"corpus": corpus, "root": str(root), "stats": stats})
    return stats


def prepare_pretrain_data(
    corpus: str,
    tokenizer_name: str,
    heldout_fraction: float,
    cache_dir: Path,
    max_bytes: int = 0,
) -> PretrainData:
    """Resolve, split, tokenize and cache a corpus; reuse the cache when nothing changed."""
    if max_bytes < 0:
        raise UserError(f"data.max_train_bytes: {max_bytes} must be >= 0 (0 means the whole corpus)")
    tokenizer = load_tokenizer(tokenizer_name)
    root, files = resolve_corpus(corpus)
    stat = {p: p.stat() for p in files}
    key = _cache_key(corpus, root, files, stat, tokenizer, heldout_fraction, max_bytes)
    out = Path(cache_dir) / f"pretrain-{tokenizer.name}-{key[:16]}"
    manifest = out / "manifest.json"
    if manifest.exists():
        stats = json.loads(manifest.read_text())["stats"]
    else:
        sizes = {p: s.st_size for p, s in stat.items()}
        stats = _build(out, corpus, root, files, sizes, tokenizer, heldout_fraction, max_bytes)
    return PretrainData(
        train_tokens=read_token_file(out / "train.bin", tokenizer),
        heldout_tokens=read_token_file(out / "heldout.bin", tokenizer),
        tokenizer=tokenizer,
        stats=stats,
        path=out,
    )


def describe(stats: dict) -> str:
    """One line for logs: sizes and the unigram baseline a model must beat."""
    h = stats["unigram_entropy_nats"]
    return (
        f"train {stats['train_tokens']:,} tokens ({stats['n_train_files']} files), "
        f"held-out {stats['heldout_tokens']:,} tokens ({stats['n_heldout_files']} files), "
        f"unigram entropy {h:.3f} nats ({h / math.log(2):.3f} bits)"
    )


def train_corpus_tokenizer(corpus: str, heldout_fraction: float, out_prefix: Path, vocab_size: int,
                           max_bytes: int = 50_000_000):
    """Trains a sentencepiece BPE on the *train* files of a corpus (held-out files never seen)."""
    from lm.data.spm import train_sentencepiece  # lazy: needs sentencepiece

    root, files = resolve_corpus(corpus)
    train, _ = split_files(root, [p for p in files if p.stat().st_size > 0], heldout_fraction)
    return train_sentencepiece((p.read_bytes() for p in train), out_prefix, vocab_size, max_bytes=max_bytes)

