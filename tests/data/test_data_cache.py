"""The prepared-data cache shared by runs: where it is, what reuses an entry, what redoes it."""

import shutil
import threading
import time

import pytest

import lm.data.curate
import lm.data.prepare as prepare
from lm.config import base_config, load_config
from lm.data.cache import cached_dir, data_cache_dir, default_cache_dir
from lm.data.prepare import prepare_pretrain_data


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "lm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lm"
    monkeypatch.setenv("LM_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    d = base_config().data
    assert data_cache_dir(d) == tmp_path / "mine"
    d.cache_dir = str(tmp_path / "override")
    assert data_cache_dir(d) == tmp_path / "override"  # data.cache_dir wins


def test_concurrent_builders_build_an_entry_once(tmp_path):
    calls, results = [], []

    def build(staging):
        calls.append(staging)
        staging.mkdir()
        time.sleep(0.3)  # long enough for the other thread to find the entry locked
        (staging / "data").write_text("x")

    threads = [threading.Thread(target=lambda: results.append(cached_dir(tmp_path, "entry", build))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(built for _, built in results) == [False, True]
    assert {path for path, _ in results} == {tmp_path / "entry"}
    assert (tmp_path / "entry" / "data").read_text() == "x"
    assert not list(tmp_path.glob(".entry*"))  # the staging dir became the entry


def test_a_failed_build_leaves_no_entry_and_the_next_one_builds(tmp_path):
    def broken(staging):
        staging.mkdir()
        (staging / "half").write_text("")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        cached_dir(tmp_path, "entry", broken)
    assert not (tmp_path / "entry").exists()
    path, built = cached_dir(tmp_path, "entry", lambda staging: (staging / "whole").write_text("ok"))
    assert built and (path / "whole").read_text() == "ok"


def _config(corpus, *overrides):
    """Lenient curation (the planted duplicate is the only drop), a small trained BPE."""
    return load_config(
        "configs/tiny.py",
        [
            f"data.corpus={corpus}",
            "data.curate=true",
            "data.workers=1",
            "data.heldout_fraction=0.3",
            "data.tokenizer=spm:512",
            "model.vocab_size=512",
            "curate.c4.enabled=false",
            "curate.fineweb.enabled=false",
            "curate.gopher_quality.enabled=false",
            "curate.gopher_repetition.enabled=false",
            "curate.language.threshold=0.2",
            *overrides,
        ],
    )


class Counts:
    """Counts curations, tokenizer trainings and tokenizations by wrapping the functions that do them."""

    def __init__(self, monkeypatch):
        self.n = {"curate": 0, "train_tokenizer": 0, "tokenize": 0}
        for name, module, attr in (
            ("curate", lm.data.curate, "curate"),
            ("train_tokenizer", prepare, "train_corpus_tokenizer"),
            ("tokenize", prepare, "tokenize_corpus"),
        ):
            monkeypatch.setattr(module, attr, self._counted(name, getattr(module, attr)))

    def _counted(self, name, fn):
        def wrapper(*args, **kw):
            self.n[name] += 1
            return fn(*args, **kw)

        return wrapper

    def since(self, before: dict) -> dict:
        return {k: v - before[k] for k, v in self.n.items()}


def _prepare(c):
    return prepare_pretrain_data(c.data, None, vocab_size=c.model.vocab_size, progress=False, curate_cfg=c.curate)


def _entries(cache):
    return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if not p.name.startswith(".")}


def test_runs_share_entries_and_a_change_redoes_only_what_it_shapes(tmp_path, corpus, monkeypatch):
    pytest.importorskip("datatrove")
    cache = tmp_path / "shared"
    monkeypatch.setenv("LM_CACHE_DIR", str(cache))
    src = tmp_path / "raw"
    shutil.copytree(corpus, src)
    counts = Counts(monkeypatch)

    first = _prepare(_config(src))
    assert counts.n == {"curate": 1, "train_tokenizer": 1, "tokenize": 1}
    entries = _entries(cache)
    assert sorted(n.split("-")[0] for n in entries) == ["curated", "shards", "tokenizer"]

    before = dict(counts.n)
    second = _prepare(_config(src))  # another run (its own workdir), same inputs and settings
    assert counts.since(before) == {"curate": 0, "train_tokenizer": 0, "tokenize": 0}
    assert _entries(cache) == entries  # nothing rewritten
    assert second.stats == first.stats and second.tokenizer.fingerprint() == first.tokenizer.fingerprint()

    before = dict(counts.n)
    _prepare(_config(src, "data.max_train_bytes=20000"))  # shapes the shards only
    assert counts.since(before) == {"curate": 0, "train_tokenizer": 0, "tokenize": 1}

    before = dict(counts.n)
    _prepare(_config(src, "curate.language.threshold=0.1"))  # a curate setting: everything after it too
    assert counts.since(before) == {"curate": 1, "train_tokenizer": 1, "tokenize": 1}

    before = dict(counts.n)
    with open(src / "abc.py", "a") as f:
        f.write("\n# one more line\n")
    _prepare(_config(src))  # a changed corpus file
    assert counts.since(before) == {"curate": 1, "train_tokenizer": 1, "tokenize": 1}
    assert set(entries) < set(_entries(cache))  # the earlier entries are still there, untouched
    assert all(_entries(cache)[name] == mtime for name, mtime in entries.items())


def test_tokenizer_settings_do_not_redo_curation(tmp_path, corpus, monkeypatch):
    pytest.importorskip("datatrove")
    monkeypatch.setenv("LM_CACHE_DIR", str(tmp_path / "shared"))
    counts = Counts(monkeypatch)
    _prepare(_config(corpus))
    before = dict(counts.n)
    _prepare(_config(corpus, "data.tokenizer=byte", "model.vocab_size=259"))
    assert counts.since(before) == {"curate": 0, "train_tokenizer": 0, "tokenize": 1}
    before = dict(counts.n)
    _prepare(_config(corpus, "data.heldout_fraction=0.4"))  # the tokenizer trains on the train split
    assert counts.since(before) == {"curate": 0, "train_tokenizer": 1, "tokenize": 1}
