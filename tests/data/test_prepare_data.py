import math

import numpy as np
import pytest

from lm.data.prepare import prepare_pretrain_data, unigram_entropy_nats
from lm.errors import UserError


def _corpus(root):
    texts = {f"doc{i}.txt": f"document {i}: " + "the quick brown fox " * (i + 1) for i in range(8)}
    texts["sub/é.md"] = "# ünïcode 🦙\n"
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "empty.txt").write_text("")
    return texts


def _mtimes(path):
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


def test_prepare_and_cache_reuse(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    texts = _corpus(corpus)
    data = prepare_pretrain_data(str(corpus), "byte", 0.25, cache)
    s = data.stats
    assert s["n_empty_files"] == 1
    assert s["n_train_files"] + s["n_heldout_files"] == len(texts)
    assert s["n_train_files"] >= 1 and s["n_heldout_files"] >= 1
    assert s["train_tokens"] == len(data.train_tokens)
    assert s["heldout_tokens"] == len(data.heldout_tokens)
    eos = data.tokenizer.eos_id
    # Nothing lost: the documents come back byte for byte, one per EOS.
    n_docs = int((data.train_tokens == eos).sum() + (data.heldout_tokens == eos).sum())
    assert n_docs == len(texts)
    decoded = data.tokenizer.decode(data.train_tokens) + data.tokenizer.decode(data.heldout_tokens)
    assert sorted(decoded) == sorted("".join(texts.values()))
    assert 0 < s["unigram_entropy_nats"] < math.log(data.tokenizer.vocab_size)

    before = _mtimes(data.path)
    again = prepare_pretrain_data(str(corpus), "byte", 0.25, cache)
    assert again.path == data.path and again.stats == s
    assert _mtimes(data.path) == before  # reused, not rewritten

    (corpus / "doc0.txt").write_text("changed, and longer than before")
    changed = prepare_pretrain_data(str(corpus), "byte", 0.25, cache)
    assert changed.path != data.path
    assert prepare_pretrain_data(str(corpus), "byte", 0.5, cache).path not in (data.path, changed.path)


def test_max_bytes_keeps_whole_files(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _corpus(corpus)
    full = prepare_pretrain_data(str(corpus), "byte", 0.25, tmp_path / "cache")
    capped = prepare_pretrain_data(str(corpus), "byte", 0.25, tmp_path / "cache", max_bytes=60)
    assert 1 <= capped.stats["n_train_files"] < full.stats["n_train_files"]
    assert capped.stats["train_bytes"] <= 60 or capped.stats["n_train_files"] == 1
    assert capped.stats["train_tokens"] == capped.stats["train_bytes"] + capped.stats["n_train_files"]
    assert capped.stats["heldout_tokens"] == full.stats["heldout_tokens"]


def test_stdlib_small(tmp_path):
    data = prepare_pretrain_data("stdlib", "byte", 0.01, tmp_path, max_bytes=50_000)
    assert 0 < data.stats["train_bytes"] <= 50_000 or data.stats["n_train_files"] == 1
    assert 2.0 < data.stats["unigram_entropy_nats"] < 5.0


def test_entropy_exact():
    assert unigram_entropy_nats(np.array([0, 1, 0, 1], np.uint16), 4) == pytest.approx(math.log(2))
    assert unigram_entropy_nats(np.array([3, 3, 3], np.uint16), 4) == 0.0


def test_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare_pretrain_data(str(tmp_path / "missing"), "byte", 0.1, tmp_path / "cache")
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(UserError, match="unknown tokenizer"):
        prepare_pretrain_data(str(tmp_path), "gpt9", 0.1, tmp_path / "cache")
    with pytest.raises(UserError, match="data.max_train_bytes"):
        prepare_pretrain_data(str(tmp_path), "byte", 0.1, tmp_path / "cache", max_bytes=-1)
