"""The manifest of a cache entry: every file's size and content hash, and checking an entry against it.

Written into the staging dir when a build finishes (so the rename that publishes
the entry publishes its manifest too). On use, sizes are checked every time
(a stat per file) and contents are hashed once per process per entry; an entry
whose files' stats changed since its hashes last matched is hashed again.
sha256 streams at about 1.2 GB/s on the reference machine (SHA extensions),
twice blake2b's speed there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lm.data.tokens import write_json

MANIFEST = ".cache-manifest.json"
FORMAT = "lm.cache.v1"
ALGORITHM = "sha256"

# entry path -> the stats of its files (and manifest) when its hashes last matched, in this process
_VERIFIED: dict[str, tuple] = {}


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def entry_files(directory: Path) -> list[str]:
    """The entry's files as sorted relative POSIX paths, the manifest left out."""
    found = []
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def write_manifest(directory: Path) -> None:
    """Records every file's size and hash in `directory` (a finished build)."""
    directory = Path(directory)
    files = {
        rel: {"size": (directory / rel).stat().st_size, ALGORITHM: file_digest(directory / rel)}
        for rel in entry_files(directory)
    }
    write_json(directory / MANIFEST, {"format": FORMAT, "algorithm": ALGORITHM, "files": files})


def _read(entry: Path) -> tuple[dict | None, str | None]:
    path = entry / MANIFEST
    if not path.is_file():
        return None, f"no {MANIFEST} (written before entries had one)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
            return None, f"{MANIFEST} is of format {manifest.get('format')!r}, expected {FORMAT!r}"
        if not all(isinstance(f, dict) and isinstance(f.get("size"), int) and f.get(ALGORITHM) for f in files.values()):
            raise ValueError("a file without size or hash")
        return manifest, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{MANIFEST} is unreadable ({e})"


def read_manifest(entry: Path) -> dict | None:
    """The entry's manifest (None if missing or unreadable)."""
    return _read(Path(entry))[0]


def _signature(entry: Path, manifest: dict) -> tuple[tuple | None, list[str]]:
    """(the stats of every listed file and of the manifest, problems): sizes and presence only."""
    stats, problems = [], []
    for rel, want in manifest["files"].items():
        try:
            st = (entry / rel).stat()
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if st.st_size != want["size"]:
            problems.append(f"{rel} has {st.st_size} bytes, the manifest says {want['size']}")
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    st = (entry / MANIFEST).stat()
    return (tuple(stats), st.st_mtime_ns, st.st_ino), problems


def _hash_problems(entry: Path, manifest: dict) -> list[str]:
    problems = []
    for rel, want in manifest["files"].items():
        try:
            if file_digest(entry / rel) != want[ALGORITHM]:
                problems.append(f"{rel} does not match its {ALGORITHM} hash")
        except OSError as e:
            problems.append(f"{rel} is unreadable ({e.strerror})")
    return problems


def entry_problem(entry: Path) -> str | None:
    """What is wrong with a cache entry, or None if it matches its manifest.

    Sizes are checked on every call; contents once per process, and again when a
    file's size, mtime or inode changed since they last matched.
    """
    entry = Path(entry)
    try:
        manifest, problem = _read(entry)
        if problem:
            return problem
        signature, problems = _signature(entry, manifest)
        if not problems and _VERIFIED.get(str(entry)) != signature:
            problems = _hash_problems(entry, manifest)
    except OSError as e:  # e.g. moved aside by another run while we looked
        return f"unreadable ({e.strerror}: '{e.filename}')"
    if problems:
        _VERIFIED.pop(str(entry), None)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return problems[0] + more
    _VERIFIED[str(entry)] = signature
    return None


def mark_verified(entry: Path) -> None:
    """Remembers an entry whose manifest was just written from its files, so its first use hashes nothing."""
    entry = Path(entry)
    manifest, _ = _read(entry)
    if manifest is not None:
        signature, problems = _signature(entry, manifest)
        if not problems:
            _VERIFIED[str(entry)] = signature


def forget_verified() -> None:
    """Forgets which entries were hashed in this process: the next use hashes them again, as a new run would."""
    _VERIFIED.clear()
