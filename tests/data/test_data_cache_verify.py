"""Cache entries are checked against their manifest on use: a changed, cut or missing file, or no
manifest, moves the entry aside and builds it again (one warning line); a good entry is reused;
an unusable cache root is one UserError line."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import lm.data.cache_manifest as cache_manifest
import lm.data.prepare as prepare
import lm.data.sft as sft
from lm.config import base_config
from lm.data.cache import cached_dir, data_cache_dir
from lm.data.cache_manifest import MANIFEST, forget_verified
from lm.data.sft import SftSettings, prepare_sft
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sft_file(tmp_path):
    lines = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ok" * i}]}
        for i in range(1, 6)
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.fixture
def sft_builds(monkeypatch):
    """Counts SFT builds (tokenizations of the file)."""
    calls = []
    tokenize = sft.tokenize_file
    monkeypatch.setattr(sft, "tokenize_file", lambda *a: calls.append(a) or tokenize(*a))
    return calls


def _prepare_sft(path, cache):
    return prepare_sft(path, ByteTokenizer(), SftSettings(seq_len=64), cache)


def _contents(entry):
    return {p.relative_to(entry).as_posix(): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def _assert_rebuilt_like_fresh(entry, fresh):
    assert _contents(entry) == _contents(fresh)  # manifest included: same files, same hashes


def _asides(entry):
    return sorted(entry.parent.glob(f".{entry.name}.bad-*"))


def test_a_changed_token_id_is_found_by_the_next_run_and_rebuilt(tmp_path, sft_builds, capsys):
    path, cache = _sft_file(tmp_path), tmp_path / "cache"
    first = _prepare_sft(path, cache)
    assert first.built and len(sft_builds) == 1
    tokens = first.path / "tokens.npy"
    stat = tokens.stat()
    ids = np.load(tokens, mmap_mode="r+")
    ids[7] += 1  # one token id off by one; size and mtime restored: only the hash can tell
    ids.flush()
    del ids, first
    os.utime(tokens, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    forget_verified()  # a new run
    capsys.readouterr()

    again = _prepare_sft(path, cache)
    assert again.built and len(sft_builds) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{again.path}'" in err[0] and "tokens.npy does not match its sha256 hash" in err[0]
    (aside,) = _asides(again.path)
    assert np.load(aside / "tokens.npy")[7] == np.load(again.path / "tokens.npy")[7] + 1  # kept for inspection
    _assert_rebuilt_like_fresh(again.path, _prepare_sft(path, tmp_path / "fresh").path)

    forget_verified()
    assert not _prepare_sft(path, cache).built and len(sft_builds) == 3  # the rebuilt entry is good (+1: fresh)
    assert capsys.readouterr().err == ""


def test_a_truncated_file_is_found_without_hashing_and_rebuilt(tmp_path, sft_builds, capsys):
    path, cache = _sft_file(tmp_path), tmp_path / "cache"
    entry = _prepare_sft(path, cache).path
    for name in ("tokens.npy", "offsets.npy"):
        size = (entry / name).stat().st_size
        with open(entry / name, "r+b") as f:
            f.truncate(size // 2)
        capsys.readouterr()
        rebuilt = _prepare_sft(path, cache)  # same process: sizes are checked on every use
        assert rebuilt.built and len(rebuilt) == 5
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and f"'{entry}'" in err[0]
            and f"{name} has {size // 2} bytes, the manifest says {size}" in err[0]
        )
    assert len(sft_builds) == 3 and len(_asides(entry)) == 2
    _assert_rebuilt_like_fresh(entry, _prepare_sft(path, tmp_path / "fresh").path)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda e: (e / "weights.npy").unlink(), "weights.npy is missing"),
        (lambda e: (e / MANIFEST).unlink(), f"no {MANIFEST} (written before entries had one)"),
        (lambda e: (e / MANIFEST).write_text("{"), f"{MANIFEST} is unreadable"),
    ],
)
def test_a_missing_file_or_manifest_rebuilds(tmp_path, sft_builds, capsys, damage, reason):
    path, cache = _sft_file(tmp_path), tmp_path / "cache"
    entry = _prepare_sft(path, cache).path
    damage(entry)
    capsys.readouterr()
    assert _prepare_sft(path, cache).built and len(sft_builds) == 2
    assert reason in capsys.readouterr().err
    _assert_rebuilt_like_fresh(entry, _prepare_sft(path, tmp_path / "fresh").path)


def test_a_good_entry_is_reused_and_hashed_once_per_process(tmp_path, sft_builds, monkeypatch):
    path, cache = _sft_file(tmp_path), tmp_path / "cache"
    hashed = []
    digest = cache_manifest.file_digest
    monkeypatch.setattr(cache_manifest, "file_digest", lambda p: hashed.append(p.name) or digest(p))
    entry = _prepare_sft(path, cache).path
    assert sorted(hashed) == ["offsets.npy", "stats.json", "tokens.npy", "weights.npy"]  # into the manifest
    hashed.clear()
    assert not _prepare_sft(path, cache).built and hashed == []  # just written: nothing to hash
    forget_verified()  # a new run: hashed once, then only sizes
    for _ in range(3):
        assert not _prepare_sft(path, cache).built
    assert sorted(hashed) == ["offsets.npy", "stats.json", "tokens.npy", "weights.npy"]
    assert len(sft_builds) == 1 and not _asides(entry)


def test_a_changed_token_in_a_shard_is_rebuilt(tmp_path, monkeypatch, capsys):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * (i + 1))
    builds = []
    tokenize = prepare.tokenize_corpus
    monkeypatch.setattr(prepare, "tokenize_corpus", lambda *a, **k: builds.append(a) or tokenize(*a, **k))
    d = base_config().data
    d.update({"corpus": str(corpus), "seq_len": 16, "heldout_fraction": 0.25, "workers": 1})
    entry = prepare.prepare_pretrain_data(d, cache, progress=False).train[0].shards.path.parent
    (shard,) = (entry / "train").glob("*.tokens")
    data = bytearray(shard.read_bytes())
    data[4] ^= 1  # one id of a uint16 shard: still inside the vocabulary
    shard.write_bytes(bytes(data))
    forget_verified()
    capsys.readouterr()
    again = prepare.prepare_pretrain_data(d, cache, progress=False)
    assert len(builds) == 2 and again.train[0].shards.path.parent == entry
    assert f"train/{shard.name} does not match its sha256 hash" in capsys.readouterr().err
    _assert_rebuilt_like_fresh(
        entry, prepare.prepare_pretrain_data(d, tmp_path / "fresh", progress=False).train[0].shards.path.parent
    )


def test_a_changed_tokenizer_model_is_retrained(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sentencepiece")
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 4)
    trained = []
    train = prepare.train_corpus_tokenizer
    monkeypatch.setattr(prepare, "train_corpus_tokenizer", lambda *a: trained.append(a) or train(*a))
    tok = prepare.resolve_tokenizer("spm:300", str(corpus), 0.25, cache)
    model = tok.path
    assert model.parent.parent == cache and model.name == f"{model.parent.name}.model"
    with open(model, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    forget_verified()
    capsys.readouterr()
    again = prepare.resolve_tokenizer("spm:300", str(corpus), 0.25, cache)
    assert len(trained) == 2 and again.path == model and again.fingerprint() == tok.fingerprint()
    assert f"{model.name} does not match its sha256 hash" in capsys.readouterr().err


def test_a_cache_root_that_is_a_file_is_one_user_error(tmp_path, monkeypatch):
    path = _sft_file(tmp_path)
    root = tmp_path / "not-a-dir"
    root.write_text("")
    monkeypatch.setenv("LM_CACHE_DIR", str(root))
    d = base_config().data
    with pytest.raises(UserError) as e:
        _prepare_sft(path, data_cache_dir(d))
    assert f"'{root}' is a file, not a directory" in str(e.value)
    assert "data.cache_dir" in str(e.value) and "$LM_CACHE_DIR" in str(e.value) and "\n" not in str(e.value)
    d.cache_dir = str(root / "below")  # below a file: cannot be created
    with pytest.raises(
        UserError,
        match=r"data cache '.*/not-a-dir/below' is not usable \(Not a directory.*"
        r"data.cache_dir \(or \$LM_CACHE_DIR\)",
    ):
        _prepare_sft(path, data_cache_dir(d))


def test_an_unwritable_cache_root_is_one_user_error(tmp_path, monkeypatch):
    path, root = _sft_file(tmp_path), tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: refuse as the kernel would for anyone else
        mkdir = pathlib.Path.mkdir

        def refused(self, *a, **k):
            if self.is_relative_to(root):
                raise PermissionError(13, "Permission denied", str(self))
            return mkdir(self, *a, **k)

        monkeypatch.setattr(pathlib.Path, "mkdir", refused)
    d = base_config().data
    d.cache_dir = str(root)
    try:
        with pytest.raises(UserError) as e:
            _prepare_sft(path, data_cache_dir(d))
    finally:
        root.chmod(0o755)
    message = str(e.value)
    assert message.startswith(f"data cache '{root}' is not usable (Permission denied")
    assert "data.cache_dir" in message and "\n" not in message


_RACE = """
import sys, time
from pathlib import Path
from lm.data.cache import cached_dir

def build(staging):
    with open(sys.argv[2], "a") as log:
        log.write("build\\n")
    staging.mkdir(parents=True, exist_ok=True)
    time.sleep(0.5)  # long enough for the other process to find the entry locked
    (staging / "data").write_text("whole")

path, built = cached_dir(Path(sys.argv[1]), "entry", build)
assert (path / "data").read_text() == "whole"
"""


def test_two_processes_rebuild_a_bad_entry_once(tmp_path):
    log = tmp_path / "builds.log"
    cached_dir(tmp_path / "cache", "entry", lambda staging: staging.mkdir() or (staging / "data").write_text("whole"))
    (tmp_path / "cache" / "entry" / "data").write_text("cut")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(tmp_path / "cache"), str(log)],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert log.read_text() == "build\n"
    assert sum("is bad (data has 3 bytes, the manifest says 5)" in e for e in errs) == 1
    assert len(_asides(tmp_path / "cache" / "entry")) == 1
