import math

import numpy as np
import pytest

from lm.config import base_config
from lm.data.pipeline import Source
from lm.data.prepare import mixture_entropy_nats, prepare_pretrain_data, unigram_entropy_nats
from lm.data.shards import ShardSet, tokenize_corpus
from lm.errors import UserError


def data_cfg(corpus="stdlib", **kw):
    d = base_config().data
    d.update({"corpus": str(corpus), "seq_len": 16, "heldout_fraction": 0.25, "workers": 1} | kw)
    return d


def write_corpus(root):
    root.mkdir(exist_ok=True)
    texts = {f"doc{i}.txt": f"document {i}: " + "the quick brown fox " * (i + 1) for i in range(8)}
    texts["sub/é.md"] = "# ünïcode 🦙\n"
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "empty.txt").write_text("")
    return texts


def shard_files(data):
    return {p: p.stat().st_mtime_ns for s in data.train + data.heldout for p in s.shards.path.iterdir()}


def test_prepare_and_cache_reuse(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    texts = write_corpus(corpus)
    data = prepare_pretrain_data(data_cfg(corpus), cache, progress=False)
    s = data.stats
    assert s["train_docs"] + s["heldout_docs"] == len(texts) and s["train_docs"] >= 1 <= s["heldout_docs"]
    assert s["sources"][0]["empty_docs"] == 1
    tok = data.tokenizer
    decoded = [tok.decode(src.shards.doc(i)) for src in data.train + data.heldout for i in range(src.shards.n_docs)]
    assert sorted(decoded) == sorted(texts.values())  # nothing lost, nothing added
    assert s["train_tokens"] == sum(len(t.encode()) + 1 for t in decoded[: s["train_docs"]])
    # Documents longer than a 16-token row are split over several rows (never truncated): all but é.md.
    longer = [t for t in decoded[: s["train_docs"]] if len(t.encode()) > 16]
    assert s["split_docs"] == len(longer)
    assert 0 < s["unigram_entropy_nats"] < math.log(tok.vocab_size)

    before = shard_files(data)
    again = prepare_pretrain_data(data_cfg(corpus), cache, progress=False)
    assert again.stats == s and shard_files(again) == before  # reused, not rewritten

    (corpus / "doc0.txt").write_text("changed, and longer than before")
    changed = prepare_pretrain_data(data_cfg(corpus), cache, progress=False)
    assert changed.train[0].shards.path != data.train[0].shards.path
    other = prepare_pretrain_data(data_cfg(corpus, heldout_fraction=0.5), cache, progress=False)
    assert other.train[0].shards.path not in (data.train[0].shards.path, changed.train[0].shards.path)


def test_max_bytes_keeps_whole_files(tmp_path):
    write_corpus(tmp_path / "corpus")
    full = prepare_pretrain_data(data_cfg(tmp_path / "corpus"), tmp_path / "cache", progress=False).stats
    capped = prepare_pretrain_data(
        data_cfg(tmp_path / "corpus", max_train_bytes=60), tmp_path / "cache", progress=False
    ).stats
    assert 1 <= capped["train_docs"] < full["train_docs"]
    assert capped["train_bytes"] <= 60 or capped["train_docs"] == 1
    assert capped["train_tokens"] == capped["train_bytes"] + capped["train_docs"]
    assert capped["heldout_tokens"] == full["heldout_tokens"]


def test_stdlib_small(tmp_path):
    s = prepare_pretrain_data(data_cfg("stdlib", max_train_bytes=50_000), tmp_path, progress=False).stats
    assert 0 < s["train_bytes"] <= 50_000 or s["train_docs"] == 1
    assert 2.0 < s["unigram_entropy_nats"] < 5.0


def test_entropy_exact():
    assert unigram_entropy_nats(np.array([2, 2, 0, 0])) == pytest.approx(math.log(2))
    assert unigram_entropy_nats(np.array([0, 0, 0, 3])) == 0.0
    one = lambda ids: ShardSet(None, {}, [np.array(ids, np.uint16)], [np.array([0, len(ids)])])  # noqa: E731
    # 3:1 mixture of "always 0" and "always 1": p = (0.75, 0.25)
    h = mixture_entropy_nats([Source("a", one([0, 0]), 3.0), Source("b", one([1, 1, 1, 1]), 1.0)], 4)
    assert h == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_sources_mix_corpora_and_tokenized_dirs(tmp_path):
    write_corpus(tmp_path / "a")
    (tmp_path / "b").mkdir()
    for i in range(4):
        (tmp_path / "b" / f"{i}.txt").write_text(f"other text {i} " * 20)
    tokenize_corpus(str(tmp_path / "b"), tmp_path / "b_shards", "byte", 0.25, progress=False)
    d = data_cfg(sources=(f"{tmp_path / 'a'}:3", f"{tmp_path / 'b_shards'}:1"))
    data = prepare_pretrain_data(d, tmp_path / "cache", progress=False)
    assert [(s.name, s.weight) for s in data.train] == [(str(tmp_path / "a"), 3.0), (str(tmp_path / "b_shards"), 1.0)]
    assert data.train[1].shards.path == tmp_path / "b_shards" / "train"  # used as it is
    assert [s["source"] for s in data.stats["sources"]] == [str(tmp_path / "a"), str(tmp_path / "b_shards")]
    assert data.stats["train_docs"] == sum(s["train_docs"] for s in data.stats["sources"])


def test_on_the_fly_sentencepiece_tokenizer(tmp_path, corpus):
    data = prepare_pretrain_data(data_cfg(corpus, tokenizer="spm:512"), tmp_path / "cache", progress=False)
    assert data.tokenizer.vocab_size == 512 and data.tokenizer.fingerprint().startswith("spm:")
    assert data.train[0].shards.manifest["tokenizer"]["fingerprint"] == data.tokenizer.fingerprint()
    again = prepare_pretrain_data(data_cfg(corpus, tokenizer="spm:512"), tmp_path / "cache", progress=False)
    assert again.tokenizer.fingerprint() == data.tokenizer.fingerprint()  # trained once, then reused
    # Shards of another tokenizer are refused, naming both.
    tokenize_corpus(str(corpus), tmp_path / "byte_shards", "byte", 0.25, progress=False)
    only_shards = data_cfg(corpus, sources=(str(tmp_path / "byte_shards"),), tokenizer=str(data.tokenizer.path))
    with pytest.raises(UserError, match=r"tokenized with 'byte-v1.*' but this run's tokenizer is 'spm:"):
        prepare_pretrain_data(only_shards, tmp_path / "cache", progress=False)
    with pytest.raises(UserError, match="holds only tokenized directories"):
        only_shards.tokenizer = "spm:512"
        prepare_pretrain_data(only_shards, tmp_path / "cache", progress=False)


def test_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare_pretrain_data(data_cfg(tmp_path / "missing"), tmp_path / "cache", progress=False)
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(UserError, match="unknown tokenizer"):
        prepare_pretrain_data(data_cfg(tmp_path, tokenizer="gpt9"), tmp_path / "cache", progress=False)
    with pytest.raises(UserError, match="spm:VOCAB_SIZE"):
        prepare_pretrain_data(data_cfg(tmp_path, tokenizer="spm:big"), tmp_path / "cache", progress=False)
    with pytest.raises(UserError, match="data.max_train_bytes"):
        prepare_pretrain_data(data_cfg(tmp_path, max_train_bytes=-1), tmp_path / "cache", progress=False)
    with pytest.raises(UserError, match="model.vocab_size=100 is smaller than the 'byte' tokenizer's 259"):
        prepare_pretrain_data(data_cfg(tmp_path), tmp_path / "cache", vocab_size=100, progress=False)


def test_curation_in_front_of_tokenizing(tmp_path, corpus):
    pytest.importorskip("datatrove")
    import json
    import shutil

    from lm.config import load_config

    src = tmp_path / "raw"
    shutil.copytree(corpus, src)
    shutil.copy(src / "abc.py", src / "abc_copy.py")  # an exact duplicate: curation drops one
    c = load_config(
        "configs/tiny.py",
        [
            f"data.corpus={src}",
            "data.curate=true",
            "data.workers=1",
            "data.heldout_fraction=0.3",
            "data.tokenizer=byte",
            "curate.c4.enabled=false",
            "curate.fineweb.enabled=false",
            "curate.gopher_quality.enabled=false",
            "curate.language.threshold=0.3",
        ],
    )
    data = prepare_pretrain_data(c.data, tmp_path / "cache", 264, progress=False, curate_cfg=c.curate)
    (curated,) = (tmp_path / "cache").glob("curated-*")
    report = json.loads((curated / "report.json").read_text())
    assert report["in"]["docs"] == 13 and report["kept"]["docs"] < 13
    s = data.stats
    assert s["train_docs"] + s["heldout_docs"] == report["kept"]["docs"]  # tokenized what curation kept
    assert data.train[0].shards.manifest["inputs"]["corpus"] == str(curated / "*.jsonl.gz")
    texts = [
        data.tokenizer.decode(src_.shards.doc(i))
        for src_ in data.train + data.heldout
        for i in range(src_.shards.n_docs)
    ]
    assert texts.count((src / "abc.py").read_text()) <= 1
