"""Large host allocations on transparent huge pages (glibc malloc tunable), set at process start.

XLA:CPU allocates a step's temporaries (hundreds of MB for a small model) afresh on every
call. glibc serves such blocks with mmap and returns them with munmap, so each step
faults in every 4 KiB page again: about 120k page faults per step for the bench shape,
10-15% of its wall time. With the `glibc.malloc.hugetlb=1` tunable, glibc asks for
transparent huge pages on those mappings (where the kernel's THP mode is `madvise` or
`always`), and the faults drop to a few hundred. glibc reads tunables only when a
process starts, so the `lm` command re-executes itself once with the tunable set.

The user's choice wins: a GLIBC_TUNABLES that already names glibc.malloc.hugetlb (for
example `glibc.malloc.hugetlb=0` to turn this off) is left alone. Nothing happens off
Linux, on another libc, on glibc older than 2.35 (no such tunable) or with THP `never`.
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: pathlib.Path = THP_MODE) -> str | None:
    """The kernel's THP mode ('always', 'madvise' or 'never'), None where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _glibc_version() -> tuple[int, ...] | None:
    if sys.platform != "linux":
        return None
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def hugepage_environ(environ, glibc: tuple[int, ...] | None, thp: str | None) -> dict | None:
    """environ with the tunable added, or None when it is already decided or would do nothing."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables or glibc is None or glibc < (2, 35) or thp not in ("always", "madvise"):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return env


def with_hugepages(environ=os.environ) -> dict:
    """A copy of environ for starting a child process with huge-page malloc (if it applies)."""
    return hugepage_environ(environ, _glibc_version(), thp_mode()) or dict(environ)


def reexec_with_hugepages() -> None:
    """Restarts this process with the tunable set, if it applies; returns only if it does not.

    Call first thing in a program's entry point: the new process runs from the start.
    """
    env = hugepage_environ(os.environ, _glibc_version(), thp_mode())
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
