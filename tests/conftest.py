"""Eight simulated CPU devices for mesh tests: must be set before jax is first imported.

Tests compile many small programs and run each a few times, so XLA compiles them at its
lowest optimisation level: the numbers are the same program's, and compiling takes half
the time. Subprocesses the tests start get the same flags (`xla_flags`).

A session shares one JAX compilation cache (a fresh directory, removed at the end) among its
workers and the `lm` processes they start: a hit loads the executable a compile would give.
It has no size bound, because the bound's eviction re-reads every entry on each write (quadratic
in entries: one test late in a session took 70 s instead of 11 s), and the directory lasts one session.
An entry read while another process still writes it fails to decompress, and JAX warns and
compiles instead. `LM_TEST_JAX_CACHE=0` turns it off."""

import gc
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile

import pytest

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_OWN_CACHE = None  # the directory the session's first process made, removed at its end


def pytest_configure(config):
    """Made here, not at import: a subprocess that imports this module makes no directory."""
    global _OWN_CACHE
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # an xdist worker: its env already names the session's directory
    if os.environ.get("LM_TEST_JAX_CACHE", "1") != "1":
        return
    _OWN_CACHE = tempfile.mkdtemp(prefix="lm-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE  # workers (started later) and subprocesses inherit it
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A few real stdlib modules: enough text for a short run."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for name in [
        "abc.py",
        "bisect.py",
        "colorsys.py",
        "copy.py",
        "fnmatch.py",
        "heapq.py",
        "keyword.py",
        "numbers.py",
        "operator.py",
        "queue.py",
        "shlex.py",
        "textwrap.py",
    ]:
        shutil.copy(stdlib / name, root / name)
    return root


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Prepared data goes to a cache shared by the session's runs, never to ~/.cache/lm."""
    os.environ["LM_CACHE_DIR"] = str(tmp_path_factory.mktemp("lm-cache"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled():
    """Each test file's compiled programs are let go at its end. A worker runs ~1,000 tests, and every
    executable XLA:CPU keeps alive holds memory mappings of its code: three model test files left
    18,000 (700 once released), so a whole worker neared the kernel's vm.max_map_count (65,530),
    where compiling the next program crashes (SIGABRT or SIGSEGV inside XLA's compile), and grew
    past 7 GB. A program compiled again loads from the session's compilation cache."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def small_base(tmp_path_factory, corpus):
    """A small byte-level model pretrained for 10 steps at seq_len 64: what fine-tuning tests start from."""
    from lm.cli import main
    from tests.e2e.test_cli_train import SMALL

    workdir = tmp_path_factory.mktemp("base") / "base"
    assert (
        main(
            [
                "train",
                "--workdir",
                str(workdir),
                f"--config.data.corpus={corpus}",
                "--config.train.steps=10",
                "--config.eval.every_steps=10",
                *SMALL,
                "--config.data.seq_len=64",
            ]
        )
        == 0
    )
    return workdir


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """End-to-end runs (tests/e2e/, all marked slow there) and the other slow tests first: with
    `-n 2 --dist loadfile --no-loadscope-reorder` (make test) the long files start at once instead of
    ending the run on one worker while the other idles."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: ("e2e" not in item.path.parts, item.get_closest_marker("slow") is None))
