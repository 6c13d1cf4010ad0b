"""Huge-page malloc at process start: when the tunable is added, that the user's choice wins,
that the re-executed process keeps its arguments, and that page faults really drop."""

import os
import subprocess
import sys

import pytest

from lm.process import hugepages
from lm.process.hugepages import TUNABLE, hugepage_environ, thp_mode

NEW_GLIBC = (2, 36)


def test_tunable_is_added_to_an_empty_or_existing_setting():
    assert hugepage_environ({}, NEW_GLIBC, "madvise")["GLIBC_TUNABLES"] == f"{TUNABLE}=1"
    env = hugepage_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}, NEW_GLIBC, "always")
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=1", "A": "b"}


def test_nothing_changes_where_it_would_do_nothing_or_the_user_decided():
    assert hugepage_environ({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, NEW_GLIBC, "madvise") is None
    assert hugepage_environ({}, None, "madvise") is None  # not glibc, or not Linux
    assert hugepage_environ({}, (2, 34), "madvise") is None  # no such tunable before 2.35
    assert hugepage_environ({}, NEW_GLIBC, "never") is None
    assert hugepage_environ({}, NEW_GLIBC, None) is None


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always"
    assert thp_mode(tmp_path / "missing") is None


applies = hugepage_environ({}, hugepages._glibc_version(), thp_mode()) is not None
needs_thp = pytest.mark.skipif(not applies, reason="needs Linux, glibc >= 2.35 and THP madvise/always")

REPORT = (
    "from lm.process.hugepages import reexec_with_hugepages; reexec_with_hugepages(); import os, sys; "
    "print(os.environ.get('GLIBC_TUNABLES', ''), sys.argv[1:])"
)


def _run(code, *args, tunables=None):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


@needs_thp
def test_reexec_sets_the_tunable_and_keeps_the_arguments():
    assert _run(REPORT, "train", "--x=1") == f"{TUNABLE}=1 ['train', '--x=1']"
    assert _run(REPORT, "a", tunables=f"{TUNABLE}=0") == f"{TUNABLE}=0 ['a']"


# Through libc's malloc directly: numpy already asks for huge pages on its own large arrays.
FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    p = libc.malloc(64 << 20)  # 64 MiB: glibc maps it afresh and unmaps it on free
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@needs_thp
def test_large_allocations_fault_in_huge_pages():
    small_pages = 4 * (64 << 20) // 4096
    with_tunable = int(_run(FAULTS, tunables=f"{TUNABLE}=1"))
    assert with_tunable < small_pages / 20, with_tunable
    if thp_mode() == "madvise":  # with 'always' the kernel already does it without the tunable
        assert int(_run(FAULTS, tunables=f"{TUNABLE}=0")) > small_pages / 2
