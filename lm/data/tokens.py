"""Token files: a flat array of ids on disk, read back as a memmap.

`<name>.bin` holds every document's ids followed by EOS, as uint16 (uint32 for
vocabularies beyond 2**16). `<name>.bin.json` holds the metadata, including the
tokenizer fingerprint so a file is never read with the wrong tokenizer. Both are
written atomically, so a crash never leaves a half-written file that looks valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from lm.errors import UserError

FORMAT = "lm.tokens.v1"


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb"):
    """Write to a temp file in the same dir; fsync and rename over `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def meta_path(path: Path) -> Path:
    return Path(str(path) + ".json")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_token_file(docs: Iterable[bytes], tokenizer, path: Path) -> dict:
    """Tokenize docs into `path` (+ `path.json`); return the metadata."""
    path = Path(path)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    n_tokens = n_docs = n_bytes = 0
    with atomic_open(path, "wb") as f:
        for doc in docs:  # streamed: the corpus never has to fit in memory
            ids = tokenizer.encode(doc)
            f.write(ids.astype(dtype).tobytes())
            f.write(eos)
            n_tokens += len(ids) + 1
            n_docs += 1
            n_bytes += len(doc.encode("utf-8") if isinstance(doc, str) else doc)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "n_tokens": n_tokens,
        "n_docs": n_docs,
        "n_bytes": n_bytes,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
    }
    # The metadata goes last: its presence means the .bin beside it is complete.
    write_json(meta_path(path), meta)
    return meta


def read_token_meta(path: Path) -> dict:
    mpath = meta_path(path)
    if not Path(path).exists() or not mpath.exists():
        raise UserError(
            f"token file '{path}' or its metadata '{mpath}' is missing; "
            "re-run data preparation to (re)build it"
        )
    return json.loads(mpath.read_text())


def read_token_file(path: Path, tokenizer) -> np.memmap:
    """Open a token file read-only, after checking it matches `tokenizer` and is intact."""
    path = Path(path)
    meta = read_token_meta(path)
    want, got = tokenizer.fingerprint(), meta.get("tokenizer_fingerprint")
    if got != want:
        raise UserError(
            f"token file '{path}' was written with tokenizer '{got}' but the current one is "
            f"'{want}'; re-tokenize the corpus or select the matching tokenizer"
        )
    dtype = np.dtype(meta["dtype"])
    size = path.stat().st_size
    if size != meta["n_tokens"] * dtype.itemsize:
        raise UserError(
            f"token file '{path}' has {size} bytes but its metadata says {meta['n_tokens']} "
            f"{dtype.name} tokens; it is truncated or stale: delete it and re-run preparation"
        )
    if meta["n_tokens"] == 0:
        return np.zeros(0, dtype)  # mmap cannot map an empty file
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = int(tokens.max())  # one cheap pass: catches corrupt files before they hit the model
    if top >= tokenizer.vocab_size:
        raise UserError(
            f"token file '{path}' contains id {top}, outside the vocabulary of size "
            f"{tokenizer.vocab_size}; the file is corrupt: delete it and re-run preparation"
        )
    return tokens
