"""The prepared-data cache shared by runs: where it lives, building an entry once, never serving a bad one.

Curated corpora, trained tokenizers, token shards and tokenized examples are expensive
and depend only on their inputs and settings, so they live outside any workdir, under
a name that fingerprints what shapes them (see `lm.data.prepare`). An entry is built
under a lock (so two runs preparing the same entry do the work once) in a staging dir
that gets a manifest of its files' sizes and hashes (`lm.data.cache_manifest`) and is
then renamed into place. An entry is used only if it matches its manifest: one that
does not (a file changed, cut short or missing, or no manifest at all: entries written
before manifests existed) is moved aside to `.<name>.bad-<time>`, for inspection, and
built again, with one warning line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lm.data import provenance
from lm.data.cache_manifest import entry_problem, mark_verified, read_manifest, write_manifest
from lm.errors import UserError

LOCKS = ".locks"
_WHERE = "set data.cache_dir (or $LM_CACHE_DIR) to a writable directory"


def default_cache_dir() -> Path:
    """$LM_CACHE_DIR, else $XDG_CACHE_HOME/lm, else ~/.cache/lm."""
    if os.environ.get("LM_CACHE_DIR"):
        return Path(os.environ["LM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lm"


def data_cache_dir(d) -> Path:
    """The cache root of a `data` config section: `data.cache_dir` if set, else the default."""
    return Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()


def _open_lock(root: Path, name: str):
    if root.exists() and not root.is_dir():
        raise UserError(f"data cache '{root}' is a file, not a directory; {_WHERE}")
    path = root / LOCKS / f"{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError as e:
        raise UserError(f"data cache '{root}' is not usable ({e.strerror}: '{e.filename}'); {_WHERE}") from None


@contextlib.contextmanager
def locked(root: Path, name: str):
    """Holds an exclusive lock on entry `name` of the cache at `root` (released if the process dies)."""
    root = Path(root)
    with _open_lock(root, name) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run that is preparing {root / name}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _move_aside(entry: Path, problem: str) -> None:
    """Renames a bad entry to `.<name>.bad-<time>` (kept for inspection) and says so in one line."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = entry.with_name(f".{entry.name}.bad-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = entry.with_name(f".{entry.name}.bad-{stamp}-{n}")
    try:
        os.rename(entry, aside)
    except OSError as e:
        raise UserError(
            f"data cache entry '{entry}' is bad ({problem}) and cannot be moved aside "
            f"({e.strerror}); delete it, or {_WHERE}"
        ) from None
    print(
        f"lm: warning: data cache entry '{entry}' is bad ({problem}); moved to '{aside}', building it again",
        file=sys.stderr,
        flush=True,
    )


def cached_dir(root: Path, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Returns (root/name, built): the entry as found if it matches its manifest, else built by
    `build(staging_dir)` first (a bad entry is moved aside).

    The staging dir has a fixed name, so a build interrupted by a crash can resume
    (curation does); only the lock holder touches it.
    """
    root = Path(root)
    final = root / name
    if final.is_dir() and entry_problem(final) is None:
        return _noted(final), False
    with locked(root, name):
        if final.is_dir() or final.exists():
            # Checked again under the lock: another run may have built or replaced it while we waited.
            problem = entry_problem(final) if final.is_dir() else "not a directory"
            if problem is None:
                return _noted(final), False
            _move_aside(final, problem)
        staging = root / f".{name}.partial"
        build(staging)
        write_manifest(staging)
        os.rename(staging, final)  # atomic: readers see no entry or the whole one, manifest included
        mark_verified(final)
    return _noted(final), True


def _noted(entry: Path) -> Path:
    """The entry, noted by its content for the run reading it (lm.data.provenance)."""
    provenance.note_entry(entry, read_manifest(entry) or {})
    return entry
