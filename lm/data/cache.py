"""The prepared-data cache shared by runs: where it lives, and building an entry once.

Curated corpora, trained tokenizers and token shards are expensive and depend only
on their inputs and settings, so they live outside any workdir, under a name that
fingerprints what shapes them (see `lm.data.prepare`). An entry is complete when
it exists under its final name: it is built under a lock (so two runs preparing
the same entry do the work once) in a staging dir that is renamed into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Callable

LOCKS = ".locks"


def default_cache_dir() -> Path:
    """$LM_CACHE_DIR, else $XDG_CACHE_HOME/lm, else ~/.cache/lm."""
    if os.environ.get("LM_CACHE_DIR"):
        return Path(os.environ["LM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lm"


def data_cache_dir(d) -> Path:
    """The cache root of a `data` config section: `data.cache_dir` if set, else the default."""
    return Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()


@contextlib.contextmanager
def locked(root: Path, name: str):
    """Holds an exclusive lock on entry `name` of the cache at `root` (released if the process dies)."""
    path = Path(root) / LOCKS / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run that is preparing {Path(root) / name}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_dir(root: Path, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Returns (root/name, built): the entry as found, or built by `build(staging_dir)` first.

    The staging dir has a fixed name, so a build interrupted by a crash can resume
    (curation does); only the lock holder touches it.
    """
    final = Path(root) / name
    if final.is_dir():
        return final, False
    with locked(root, name):
        if final.is_dir():  # built by another run while we waited
            return final, False
        staging = Path(root) / f".{name}.partial"
        build(staging)
        os.rename(staging, final)  # atomic: readers see no entry or the whole one
    return final, True

