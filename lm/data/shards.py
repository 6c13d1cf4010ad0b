"""Token shards: documents tokenized in parallel into random-access shard sets.

A tokenized corpus is a directory with one shard set per split (`train/`,
`heldout/`). A shard set holds, per shard `NNNNN`:

  NNNNN.tokens   every document's ids followed by EOS (uint16, or uint32 for
                 vocabularies beyond 2**16), read back as a memmap
  NNNNN.offsets  int64 start of each document in .tokens, plus the total: n_docs + 1

and a `manifest.json` with the tokenizer fingerprint, dtype, counts and inputs.
Every file is written to a temp name and renamed; the manifest goes last, so a
crash never leaves a shard set that looks whole. Tokenization is deterministic,
so a rebuild yields identical bytes; a rebuild with unchanged inputs is skipped.

Held-out membership is decided per source: a plain file by its path (as in
`lm.data.corpus.split_files`), a JSONL document by a hash of its text, so an
exact duplicate never lands on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lm.data import progress as shown
from lm.data.corpus import is_jsonl, iter_documents, resolve_corpus, split_files, unit_hash
from lm.data.tokenizer import load_tokenizer
from lm.data.tokens import atomic_open, token_dtype, write_json
from lm.errors import UserError

FORMAT = "lm.shards.v1"
SPLITS = ("train", "heldout")
UNIT_BYTES = 16 << 20  # plain files are grouped into units of at most about this size (one shard each)
MIN_UNIT_BYTES = 1 << 20  # ... and at least this, aiming at 16 units so small corpora still use every core


@dataclasses.dataclass(frozen=True)
class Unit:
    """One task for a worker: some input files -> one shard per split."""

    index: int
    root: str
    files: tuple[str, ...]
    heldout_files: frozenset[str]  # plain files held out; JSONL documents are split by text hash
    heldout_fraction: float


class _SplitWriter:
    """Streams one split's documents of a unit to a temp file, renamed when `stack` closes
    without error; `meta` writes the offsets (also atomically) and describes the shard."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, eos_id: int, stack):
        self.directory, self.name, self.dtype, self.stack = directory, name, dtype, stack
        self.eos = np.array([eos_id], dtype).tobytes()
        self.file = None
        self.offsets, self.n_tokens, self.n_bytes, self.max_id = [0], 0, 0, -1

    def add(self, ids: np.ndarray, n_bytes: int) -> None:
        if self.file is None:  # lazily: a split that gets no document gets no files
            self.file = self.stack.enter_context(atomic_open(self.directory / f"{self.name}.tokens", "wb"))
        self.file.write(ids.astype(self.dtype).tobytes())
        self.file.write(self.eos)
        self.n_tokens += len(ids) + 1
        self.offsets.append(self.n_tokens)
        self.n_bytes += n_bytes
        self.max_id = max(self.max_id, int(ids.max(initial=0)))

    def meta(self, files: list[str]) -> dict | None:
        if self.file is None:
            return None
        with atomic_open(self.directory / f"{self.name}.offsets", "wb") as f:
            f.write(np.asarray(self.offsets, np.int64).tobytes())
        return {
            "name": self.name,
            "n_docs": len(self.offsets) - 1,
            "n_tokens": self.n_tokens,
            "n_bytes": self.n_bytes,
            "max_id": self.max_id,
            "files": files,
        }


_TOKENIZERS: dict = {}  # per worker process: loaded once


def _tokenizer(name):
    if not isinstance(name, str):  # already a tokenizer (in-process use)
        return name
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(name)
    return _TOKENIZERS[name]


def _is_heldout(unit: Unit, path: Path, doc) -> bool:
    if is_jsonl(path):
        return unit_hash(doc.encode("utf-8")) < unit.heldout_fraction
    return str(path) in unit.heldout_files


def tokenize_unit(unit: Unit, tokenizer_name, out_dir: str) -> dict:
    """Tokenizes one unit; returns {split: shard meta or None, 'skipped': counts}."""
    tok = _tokenizer(tokenizer_name)
    dtype, root = token_dtype(tok.vocab_size), Path(unit.root)
    skipped = {"empty_docs": 0, "invalid_utf8_docs": 0}
    files = {s: [] for s in SPLITS}
    with contextlib.ExitStack() as stack:
        writers = {s: _SplitWriter(Path(out_dir) / s, f"{unit.index:05d}", dtype, tok.eos_id, stack) for s in SPLITS}
        for name in unit.files:
            path = Path(name)
            rel = path.relative_to(root).as_posix()
            for doc, _where in iter_documents(path):
                raw = doc.encode("utf-8") if isinstance(doc, str) else doc
                if not raw:
                    skipped["empty_docs"] += 1
                    continue
                if isinstance(doc, bytes) and not _valid_utf8(doc):
                    skipped["invalid_utf8_docs"] += 1  # kept: byte ids are lossless, sentencepiece sees U+FFFD
                split = "heldout" if _is_heldout(unit, path, doc) else "train"
                writers[split].add(tok.encode(doc), len(raw))
                if not files[split] or files[split][-1] != rel:
                    files[split].append(rel)
        out = {s: writers[s].meta(files[s]) for s in SPLITS}
    return out | {"skipped": skipped}


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _tokenize_unit_star(args):
    return tokenize_unit(*args)


def plan_units(root: Path, files: list[Path], heldout: set[Path], heldout_fraction: float) -> list[Unit]:
    """Groups files into units: each JSONL file alone, plain files in runs of 1-16 MB (about 16 units).

    Depends only on the file list and sizes, never on the worker count, so the
    shards come out the same however many workers write them.
    """
    total = sum(p.stat().st_size for p in files if not is_jsonl(p))
    unit_bytes = min(UNIT_BYTES, max(MIN_UNIT_BYTES, total // 16))
    groups, current, size = [], [], 0
    for p in files:
        if is_jsonl(p):
            groups.append([p])
            continue
        if current and size + p.stat().st_size > unit_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += p.stat().st_size
    if current:
        groups.append(current)
    held = frozenset(str(p) for p in heldout)
    return [
        Unit(i, str(root), tuple(str(p) for p in g), held & {str(p) for p in g}, heldout_fraction)
        for i, g in enumerate(groups)
    ]


def _run_units(units: list[Unit], tokenizer_name, out_dir: Path, workers: int, progress: bool):
    tasks = [(u, tokenizer_name, str(out_dir)) for u in units]
    total = sum(Path(f).stat().st_size for u in units for f in u.files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not shown.bars(progress), delay=2.0)
    lines = shown.StageLines("tokenize", 1, shown.lines(progress))
    workers = min(workers or os.cpu_count() or 1, len(units))
    with contextlib.ExitStack() as stack:
        if workers > 1:
            # spawn: the caller may have started threads (jax), which fork would copy half-locked.
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers))
            results_iter = pool.imap(_tokenize_unit_star, tasks)
        else:
            results_iter = map(_tokenize_unit_star, tasks)
        results = []
        for unit, result in zip(units, results_iter):
            results.append(result)
            bar.update(sum(Path(f).stat().st_size for f in unit.files))
    bar.close()
    lines.finished(f"{total / 1e6:,.1f} MB in {len(units)} unit(s) with {workers} worker(s)")
    return results


def _manifest(split: str, key: str, tok, results: list[dict], inputs: dict) -> dict:
    """The split's shards and totals; `skipped` counts the whole input (both splits)."""
    shards = [r[split] for r in results if r[split] is not None]
    skipped = {k: sum(r["skipped"][k] for r in results) for k in results[0]["skipped"]}
    return {
        "format": FORMAT,
        "split": split,
        "key": key,
        "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": {
            "name": tok.name,
            "fingerprint": tok.fingerprint(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "n_docs": sum(s["n_docs"] for s in shards),
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "n_bytes": sum(s["n_bytes"] for s in shards),
        "max_id": max((s["max_id"] for s in shards), default=-1),
        "skipped": skipped,
        "inputs": inputs,
        "shards": shards,
    }


def input_key(root: Path, files: list[Path], tok, heldout_fraction: float, max_train_bytes: int) -> str:
    """A hash of everything that determines the shards of a resolved corpus (files, sizes, mtimes, ...)."""
    described = {
        "format": FORMAT,
        "root": str(root.resolve()),
        "tokenizer": tok.fingerprint(),
        "heldout_fraction": heldout_fraction,
        "max_train_bytes": max_train_bytes,
        "files": [[p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _select(root: Path, files: list[Path], heldout_fraction: float, max_train_bytes: int):
    """(files to read, plain files held out): the split and the byte cap, as in lm.data.corpus."""
    if not 0.0 < heldout_fraction < 1.0:
        raise UserError(f"data.heldout_fraction: {heldout_fraction} must be between 0 and 1 (exclusive)")
    plain = [p for p in files if not is_jsonl(p) and p.stat().st_size > 0]
    jsonl = [p for p in files if is_jsonl(p)]
    if plain and (len(plain) >= 2 or not jsonl):
        train, heldout = split_files(root, plain, heldout_fraction)
    else:
        train, heldout = plain, []
    if max_train_bytes > 0:  # the longest prefix of whole files within the cap (at least one)
        kept, total = [], 0
        for p in train + jsonl:
            if kept and total + p.stat().st_size > max_train_bytes:
                break
            kept.append(p)
            total += p.stat().st_size
        train, jsonl = [p for p in kept if not is_jsonl(p)], [p for p in kept if is_jsonl(p)]
    chosen = set(train) | set(heldout) | set(jsonl)
    n_empty = sum(not is_jsonl(p) and p.stat().st_size == 0 for p in files)
    return [p for p in files if p in chosen], set(heldout), n_empty


def tokenize_corpus(
    corpus: str,
    out_dir: Path,
    tokenizer_name,
    heldout_fraction: float,
    *,
    max_train_bytes: int = 0,
    workers: int = 0,
    progress: bool = True,
    resolved: tuple[Path, list[Path]] | None = None,
) -> dict[str, dict]:
    """Tokenizes a corpus spec ('stdlib', directory or glob; plain or JSONL files) into
    `out_dir/train` and `out_dir/heldout`. Returns {split: manifest}. A no-op if
    `out_dir` already holds the shards of exactly these inputs.

    `tokenizer_name` is what `load_tokenizer` takes ('byte' or a .model path), or a
    tokenizer object that pickles (worker processes load or unpickle their own).
    `resolved` is `resolve_corpus(corpus)` when the caller has it already.
    """
    if max_train_bytes < 0:
        raise UserError(f"data.max_train_bytes: {max_train_bytes} must be >= 0 (0 means the whole corpus)")
    tok = _tokenizer(tokenizer_name)
    root, files = resolved or resolve_corpus(corpus)
    key = input_key(root, files, tok, heldout_fraction, max_train_bytes)
    out_dir = Path(out_dir)
    existing = {s: read_manifest(out_dir / s) for s in SPLITS}
    if all(m is not None and m.get("key") == key for m in existing.values()):
        return existing
    if any(m is not None and m.get("key") != key for m in existing.values()):
        raise UserError(
            f"'{out_dir}' holds shards of other inputs or another tokenizer; choose a new output directory or delete it"
        )
    selected, heldout, n_empty = _select(root, files, heldout_fraction, max_train_bytes)
    units = plan_units(root, selected, heldout, heldout_fraction)
    results = _run_units(units, tokenizer_name, out_dir, workers, progress)
    results.append({s: None for s in SPLITS} | {"skipped": {"empty_docs": n_empty, "invalid_utf8_docs": 0}})
    inputs = {"corpus": corpus, "root": str(root), "n_files": len(selected)}
    manifests = {s: _manifest(s, key, tok, results, inputs) for s in SPLITS}
    for split, m in manifests.items():
        if m["n_docs"] == 0:
            raise UserError(
                f"data: '{corpus}' gave no {split} documents ({m['skipped']}); "
                "use more input or another data.heldout_fraction"
            )
    for split, m in manifests.items():  # last: their presence marks complete shard sets
        write_json(out_dir / split / "manifest.json", m)
    return manifests


def train_documents(corpus: str, heldout_fraction: float):
    """The train split's documents of a corpus, in order (e.g. to train a tokenizer on)."""
    root, files = resolve_corpus(corpus)
    selected, heldout, _ = _select(root, files, heldout_fraction, 0)
    unit = Unit(0, str(root), (), frozenset(str(p) for p in heldout), heldout_fraction)
    for path in selected:
        for doc, _where in iter_documents(path):
            if doc and not _is_heldout(unit, path, doc):
                yield doc


def is_shard_dir(spec: str) -> bool:
    """True for a directory written by `lm tokenize` (both splits complete)."""
    return all((Path(spec) / s / "manifest.json").is_file() for s in SPLITS)


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise UserError(f"'{path}' is not a {FORMAT} manifest (format {manifest.get('format')!r})")
    return manifest


@dataclasses.dataclass
class ShardSet:
    """A read-only shard set: documents by global index, each ending in EOS."""

    path: Path
    manifest: dict
    tokens: list[np.ndarray]  # one memmap per shard
    offsets: list[np.ndarray]  # per shard: n_docs + 1 document starts

    def __post_init__(self):
        self.first_doc = np.cumsum([0] + [len(o) - 1 for o in self.offsets])

    @property
    def n_docs(self) -> int:
        return int(self.first_doc[-1])

    def doc_lengths(self) -> np.ndarray:
        """Tokens per document (including its EOS), in document order."""
        return np.concatenate([np.diff(o) for o in self.offsets]) if self.offsets else np.zeros(0, np.int64)

    def doc(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self.first_doc, i, side="right")) - 1
        local = i - self.first_doc[shard]
        start, stop = self.offsets[shard][local], self.offsets[shard][local + 1]
        return self.tokens[shard][start:stop]


def _open_shard(directory: Path, meta: dict, dtype: np.dtype, vocab_size: int):
    tokens_path, offsets_path = directory / f"{meta['name']}.tokens", directory / f"{meta['name']}.offsets"
    for path, want in ((tokens_path, meta["n_tokens"] * dtype.itemsize), (offsets_path, (meta["n_docs"] + 1) * 8)):
        size = path.stat().st_size if path.exists() else None
        if size != want:
            raise UserError(
                f"shard file '{path}' has {size} bytes but the manifest says {want}; it is "
                "missing, truncated or stale: delete the shard set and tokenize again"
            )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
    offsets = np.fromfile(offsets_path, dtype=np.int64)
    top = int(tokens.max())  # one pass: a corrupt file fails here, not as NaNs in the model
    if top >= vocab_size:
        raise UserError(
            f"shard file '{tokens_path}' contains token id {top}, outside the run's vocabulary "
            f"of {vocab_size} ids; the file is corrupt or from a larger tokenizer"
        )
    return tokens, offsets


def open_shards(directory: Path, tokenizer, vocab_size: int | None = None) -> ShardSet:
    """Opens a shard set after checking tokenizer, sizes and id range against the run.

    `vocab_size` is the model's: ids must lie below it and below the tokenizer's.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise UserError(
            f"'{directory}' holds no complete shard set (no manifest.json); run `lm tokenize` (again) to build it"
        )
    got, want = manifest["tokenizer"]["fingerprint"], tokenizer.fingerprint()
    if got != want:
        raise UserError(
            f"shard set '{directory}' was tokenized with '{got}' but this run's tokenizer is "
            f"'{want}'; tokenize again with this tokenizer or select the matching one"
        )
    limit = min(tokenizer.vocab_size, vocab_size or tokenizer.vocab_size)
    dtype = np.dtype(manifest["dtype"])
    opened = [_open_shard(directory, meta, dtype, limit) for meta in manifest["shards"]]
    return ShardSet(directory, manifest, [t for t, _ in opened], [o for _, o in opened])
