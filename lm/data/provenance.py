"""The content of the data a run reads, noted as it is read: what a run's identity records
(lm.train.identity), so --resume can tell the same data from other data behind the same paths.

Readers note each input by content: a prepared cache entry by the hashes in its manifest, a
file read directly by its sha256. `recording()` collects the notes of one stage's reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

_NOTES: dict | None = None


@contextlib.contextmanager
def recording():
    """Collects {label: digest} of every input read inside the block (labels number the inputs
    of one kind in the order they are read: the same reading gives the same labels)."""
    global _NOTES
    _NOTES = {}
    try:
        yield _NOTES
    finally:
        _NOTES = None


def note(label: str, digest: str) -> None:
    if _NOTES is not None:
        n = sum(1 for k in _NOTES if k.rsplit("#", 1)[0] == label)
        _NOTES[f"{label}#{n + 1}"] = digest


def note_entry(entry: Path, manifest: dict) -> None:
    """A cache entry, by the sizes and hashes of its data files: not by where it lives, nor by its
    .json metadata (stats, shard lists), which names the paths it was built from."""
    data = {k: v for k, v in (manifest.get("files") or {}).items() if not k.endswith(".json")}
    files = json.dumps(data, sort_keys=True).encode()
    note(Path(entry).name.split("-", 1)[0], hashlib.sha256(files).hexdigest()[:16])


def note_file(label: str, path: Path) -> None:
    if _NOTES is None:
        return
    with open(path, "rb") as f:
        note(label, hashlib.file_digest(f, "sha256").hexdigest()[:16])
