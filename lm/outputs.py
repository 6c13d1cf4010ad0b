"""Output paths of the verbs that write results: checked before any work, written so that nothing is
lost at the edges.

- `check_out` refuses, in one line, an output that exists (unless the verb was given --overwrite),
  a run's workdir or any path inside it, and a place that cannot be written
  (a parent that is a file, a folder without write permission, a name the system refuses).
- `replacing` gives a temporary name beside the output; what is written there is renamed over the
  output only when the block ends without an error, so an interrupted writer leaves the output as
  it was. Files get the mode of the user's umask (0644 by default), whoever created them.
- A directory output is never removed: a verb replaces only the files it writes (each atomically)
  and its own subfolders (written beside, then swapped in by rename).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil

from lm.errors import UserError

# What marks a run's workdir (lm.train.workdir: the lock, its checkpoints and its metrics): no result is
# written in it.
WORKDIR_MARKS = ("checkpoints", "metrics.jsonl")


def umask() -> int:
    """The process's umask, read without changing it where the system allows (threads may be writing)."""
    with contextlib.suppress(OSError, ValueError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from the umask: 0644 under the usual 022."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


def is_workdir(path: pathlib.Path) -> bool:
    """A folder holding a run: its checkpoints/ or its metrics, or the lock of a run with its config (a
    lock alone is any tool's)."""
    if not path.is_dir():
        return False
    return any((path / mark).exists() for mark in WORKDIR_MARKS) or (
        (path / ".lock").is_file() and (path / "config.json").is_file()
    )


def check_out(path, overwrite: bool = False, flag: str = "--out", kind: str = "file") -> pathlib.Path:
    """`path` as an output of kind 'file' or 'dir', checked before any work; a UserError otherwise.

    An existing file (or a directory that is not empty) is refused unless `overwrite`; a directory
    output with `overwrite` keeps everything but what the verb writes."""
    text = str(path)
    if not text.strip():
        raise UserError(f"{flag} is empty; expected a {'directory' if kind == 'dir' else 'file'} path")
    path = pathlib.Path(path)
    try:
        _check_not_in_run(path, flag)
        exists = path.exists() or path.is_symlink()
        if exists:
            _check_existing(path, overwrite, flag, kind)
        _check_writable(path, exists, flag, kind)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot be written there ({e.strerror or e}); choose another path") from None
    except ValueError as e:  # e.g. a NUL byte in the name
        raise UserError(f"{flag} {path!r}: not a usable path ({e})") from None
    return path


def _check_not_in_run(path: pathlib.Path, flag: str) -> None:
    """A run's workdir belongs to the run (its checkpoints, metrics and files, and what a resume or a
    cleanup of it does): results go beside it, never in it."""
    full = pathlib.Path(os.path.realpath(path))
    if is_workdir(full):
        raise UserError(
            f"{flag} {path}: is a run's workdir (it holds {_marks(full)}); writing there could replace "
            f"the run's own files: choose a path outside it, e.g. {full.name}-export"
        )
    above = next((p for p in full.parents if is_workdir(p)), None)
    if above is not None:
        raise UserError(
            f"{flag} {path}: is inside the run's workdir '{above}'; a run's workdir holds the run's "
            f"files only: choose a path outside it, e.g. beside it as '{above.name}-"
            f"{full.relative_to(above).parts[0]}'"
        )


def _marks(path: pathlib.Path) -> str:
    return ", ".join(m for m in (*WORKDIR_MARKS, ".lock") if (path / m).exists())


def _check_existing(path: pathlib.Path, overwrite: bool, flag: str, kind: str) -> None:
    if kind == "dir":
        if not path.is_dir():
            raise UserError(f"{flag} {path}: exists and is not a directory; expected a directory (or a new path)")
        if not overwrite and any(path.iterdir()):
            raise UserError(
                f"{flag} {path}: the directory exists and is not empty; add --overwrite to replace the "
                "files lm writes there (nothing else in it is touched), or choose a new path"
            )
        return
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; expected a file path")
    if not overwrite:
        raise UserError(f"{flag} {path}: already exists; add --overwrite to replace it, or choose a new path")


def _check_writable(path: pathlib.Path, exists: bool, flag: str, kind: str) -> None:
    """The folder that is written in: the output itself (an existing directory), else the nearest
    existing folder above it (the output is written beside, then renamed)."""
    here = path if exists and kind == "dir" else path.absolute().parent
    while not here.exists() and not here.is_symlink():
        here = here.parent
    if not here.is_dir():
        raise UserError(f"{flag} {path}: '{here}' is a file, not a directory; expected a path in a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        raise UserError(
            f"{flag} {path}: the directory '{here}' is not writable; fix its permissions or choose another path"
        )


def temp_name(path) -> pathlib.Path:
    """A hidden name beside `path` that no other writer uses."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _settle_modes(tmp: pathlib.Path, directory: bool) -> None:
    """Modes from the umask for what a writer created (some libraries create files 0600)."""
    if not directory:
        os.chmod(tmp, file_mode())
        return
    os.chmod(tmp, dir_mode())
    for root, dirs, files in os.walk(tmp):
        for d in dirs:
            os.chmod(os.path.join(root, d), dir_mode())
        for f in files:
            os.chmod(os.path.join(root, f), file_mode())


def _remove(path: pathlib.Path) -> None:
    """Removes a temporary (or a replaced copy of this verb's own output): a file or a folder tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def publish(tmp, path, directory: bool = False) -> None:
    """Renames the finished temporary `tmp` over `path`, with modes from the umask. A directory
    replaces the previous one of the same name (this verb's own output) by two renames."""
    tmp, path = pathlib.Path(tmp), pathlib.Path(path)
    _settle_modes(tmp, directory)
    if not directory or not (path.exists() or path.is_symlink()):
        os.replace(tmp, path)
        return
    old = temp_name(path)
    os.replace(path, old)
    os.replace(tmp, path)
    _remove(old)


@contextlib.contextmanager
def replacing(path, directory: bool = False):
    """Yields a temporary path beside `path` to write a file (or fill a folder) at; on success it
    replaces `path`, on any error (an interrupt included) it is removed and `path` stays as it was."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        publish(tmp, path, directory)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", encoding: str | None = "utf-8"):
    """A file object writing to a temporary beside `path`, renamed over it when the block succeeds."""
    with replacing(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_text(path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_bytes(path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def copy_file(source, path) -> None:
    """A copy of `source` at `path`, replaced atomically."""
    with replacing(path) as tmp:
        shutil.copyfile(source, tmp)
