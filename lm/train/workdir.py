"""A run's workdir: one writer at a time, and everything a run writes checked writable before
any data work.

The lock is `<workdir>/.lock`, held with fcntl.flock for the life of the run: the kernel
releases it when the process ends however it ends, so a lock file left by a killed run is
recognised (nobody holds it) and taken over. The file names its holder (pid, host, start
time, command) for the message that refuses a second writer. On several processes of one run
only process 0 takes it: they all share the workdir.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import socket
import sys
import time

from lm.errors import UserError
from lm.outputs import write_text

LOCK = ".lock"
# Folders a run writes into beside the workdir's own files (checkpoints/STEP: old steps are deleted).
FOLDERS = ("checkpoints", "tensorboard", "rejected_checkpoints")


class WorkdirLock:
    """An exclusive lock on a workdir; `release()` (or leaving its `with`) gives it back, removes
    the lock file and the folders it had to create, if they are still empty."""

    def __init__(self, path: pathlib.Path, fd: int, created: list[pathlib.Path]):
        self.path, self._fd, self._created = path, fd, created

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: a process that opened it before gets a stale inode
        os.close(self._fd)  # and retries (`lock_workdir`)
        self._fd = None
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: a refused run leaves no trace

    def __enter__(self) -> "WorkdirLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def lock_workdir(workdir) -> WorkdirLock:
    """Takes the lock of `workdir` (created if missing) or raises a UserError naming its holder."""
    workdir = pathlib.Path(workdir)
    created = [p for p in (workdir, *workdir.parents) if not p.exists()]
    path = workdir / LOCK
    for _ in range(20):  # a holder releasing at this very moment unlinks the file: open it again
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise UserError(
                f"cannot create the lock file '{path}' ({e.strerror}); the run writes in '{workdir}': "
                "fix its permissions or choose another --workdir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(
                f"'{workdir}' is in use by another run ({_describe(holder)}; lock file '{path}'); "
                "wait for it to end or choose another --workdir"
            ) from None
        if not _same_file(fd, path):
            os.close(fd)
            continue
        previous = _read(fd)
        if previous:
            print(
                f"lm: note: taking over '{path}' from {_describe(previous)}, which ended without removing it",
                file=sys.stderr,
            )
        _write_holder(fd)
        return WorkdirLock(path, fd, [p for p in reversed(created)])
    raise UserError(f"could not take the lock '{path}': it keeps being replaced; is another run starting there?")


def _same_file(fd: int, path: pathlib.Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 65536)
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _read_holder(fd: int) -> dict | None:
    """The holder's description; it writes it just after taking the lock, so wait a moment for it."""
    for _ in range(20):
        holder = _read(fd)
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def _write_holder(fd: int) -> None:
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"


def check_writable(workdir) -> None:
    """Everything a run writes in `workdir` must be writable; checked before any data work.

    A missing workdir needs the nearest existing folder above it; an existing one needs itself,
    its files and the folders a run writes into (checkpoints/ and its steps, tensorboard/, ...).
    """
    workdir = pathlib.Path(workdir)
    if not workdir.exists():
        above = next(p for p in workdir.absolute().parents if p.exists())
        if not above.is_dir():
            raise UserError(f"--workdir {workdir}: '{above}' is a file, not a folder")
        _require(above, f"--workdir {workdir} must be created in '{above}', which is not writable")
        return
    if not workdir.is_dir():
        raise UserError(f"--workdir {workdir} is a file, not a folder")
    _require(workdir)
    for path in sorted(workdir.iterdir()):
        if path.is_file():
            _require(path)
    for name in FOLDERS:
        folder = workdir / name
        if folder.exists() and not folder.is_dir():
            raise UserError(
                f"'{folder}' is a file where the run keeps a folder; move it away or choose another --workdir"
            )
        if folder.is_dir():
            _require(folder)
            for step in sorted(folder.iterdir()):
                if step.is_dir():
                    _require(step)


def _require(path: pathlib.Path, what: str | None = None) -> None:
    mode = os.W_OK | (os.X_OK if path.is_dir() else 0)
    if not os.access(path, mode):
        what = what or f"'{path}' is not writable and the run writes {'in it' if path.is_dir() else 'it'}"
        raise UserError(f"{what}; fix its permissions (chmod u+w) or choose another --workdir")


def write_atomic(path, text: str) -> None:
    """`text` at `path` whole or not at all: a kill leaves the old file or the new one (lm.outputs)."""
    write_text(path, text)
