"""What a model on disk is, in one short digest: how a run records the models it starts from or
holds frozen (its init, a DPO reference, a teacher, a reward model) and notices when one changed.

- A run directory: its newest checkpoint (what `load_init` reads) named by its step and the
  digest of its sealed meta item, which covers the shape and checksum of every state array.
- An export, a .safetensors file or a Hugging Face directory: every file's relative name and
  size, and a sha256 of sampled blocks of its bytes (the first and last MiB and 16 blocks
  between): a few MiB read per file, whatever the model's size. A fine-tune of the same base, a
  re-export or a file replaced by another model changes it; copying the files elsewhere does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

BLOCK = 1 << 20
SPREAD, SPREAD_BLOCK = 16, 1 << 16


def model_fingerprint(path) -> str:
    """The digest of the model at `path` (a run directory, an export, a .safetensors file or a
    Hugging Face directory); "" for a path that holds none of these."""
    path = pathlib.Path(path)
    if (path / "checkpoints").is_dir():
        return _run(path / "checkpoints")
    if path.is_file():
        return _digest([_file_entry(path, path.name)])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        return _digest([_file_entry(p, p.relative_to(path).as_posix()) for p in files])
    return ""


def _run(checkpoints: pathlib.Path) -> str:
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())
    for step in reversed(steps):
        try:
            meta = json.loads((checkpoints / str(step) / "meta" / "metadata").read_text())
        except (OSError, ValueError):
            continue  # the loader skips it too (read_checkpoint_params picks the newest)
        body = (
            meta.get("meta_checksum")
            or hashlib.sha256(json.dumps(meta.get("checksums"), sort_keys=True).encode()).hexdigest()
        )
        return _digest([["run-step", step, body]])
    return ""


def _file_entry(path: pathlib.Path, name: str) -> list:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * BLOCK + SPREAD * SPREAD_BLOCK:
            digest.update(f.read())
        else:
            for offset, length in _blocks(size):
                f.seek(offset)
                digest.update(f.read(length))
    return [name, size, digest.hexdigest()]


def _blocks(size: int):
    yield 0, BLOCK
    middle = size - 2 * BLOCK
    for i in range(SPREAD):
        yield BLOCK + (middle - SPREAD_BLOCK) * i // max(SPREAD - 1, 1), SPREAD_BLOCK
    yield size - BLOCK, BLOCK


def _digest(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_or_empty(path: str) -> str:
    """model_fingerprint for a config value that may be empty ("" then)."""
    return model_fingerprint(path) if path and os.path.exists(path) else ""
