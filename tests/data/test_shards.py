import gzip
import json

import numpy as np
import pytest

from lm.data import shards as shards_mod
from lm.data.corpus import split_files, unit_hash
from lm.data.shards import open_shards, tokenize_corpus
from lm.data.tokenizer import ByteTokenizer
from lm.data.tokens import token_dtype
from lm.errors import UserError

EOS = ByteTokenizer.eos_id


class OtherTokenizer(ByteTokenizer):
    def fingerprint(self):
        return "other-v9"


class WideTokenizer(ByteTokenizer):
    """Byte ids shifted past 2**16: needs uint32 shards."""

    vocab_size = 70_000
    eos_id = 69_999

    def encode(self, text):
        return super().encode(text) + 65_600

    def fingerprint(self):
        return "wide-v1"


def write_corpus(root):
    docs = {f"doc{i}.txt": f"document {i}: ünïcode 🦙 " * (i + 1) for i in range(8)}
    for rel, text in docs.items():
        (root / rel).write_text(text, encoding="utf-8")
    raw = {rel: text.encode() for rel, text in docs.items()}
    (root / "latin1.txt").write_bytes(b"caf\xe9 au lait")  # not UTF-8
    raw["latin1.txt"] = b"caf\xe9 au lait"
    (root / "empty.txt").write_text("")
    return raw


def read_docs(shard_set):
    return [shard_set.doc(i) for i in range(shard_set.n_docs)]


def tree_bytes(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_plain_corpus_round_trip(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    raw = write_corpus(corpus)
    m = tokenize_corpus(str(corpus), tmp_path / "out", "byte", 0.25, progress=False)
    tok = ByteTokenizer()
    sets = {s: open_shards(tmp_path / "out" / s, tok) for s in ("train", "heldout")}
    files = sorted(corpus / rel for rel in raw)
    train_files, heldout_files = split_files(corpus, files, 0.25)  # the same split as before shards
    for split, expected in (("train", train_files), ("heldout", heldout_files)):
        docs = read_docs(sets[split])
        assert [d[-1] for d in docs] == [EOS] * len(expected)  # one EOS ends each document
        assert [bytes(d[:-1].astype(np.uint8)) for d in docs] == [p.read_bytes() for p in expected]
        assert m[split]["n_docs"] == len(expected)
        assert m[split]["n_bytes"] == sum(len(p.read_bytes()) for p in expected)
        assert m[split]["n_tokens"] == m[split]["n_bytes"] + len(expected)
        assert m[split]["dtype"] == "uint16" and sets[split].tokens[0].dtype == np.uint16
        assert m[split]["tokenizer"]["fingerprint"] == tok.fingerprint()
        assert json.loads((tmp_path / "out" / split / "manifest.json").read_text()) == m[split]
    # Counted over the whole input: the empty file is skipped, the Latin-1 one kept (byte ids are lossless).
    assert m["train"]["skipped"] == m["heldout"]["skipped"] == {"empty_docs": 1, "invalid_utf8_docs": 1}
    # Nothing but the final files: temp files were renamed, not left behind.
    assert all(not p.name.startswith(".") for p in (tmp_path / "out").rglob("*"))


def test_rerun_is_a_noop_and_rebuilds_are_identical(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus)
    tokenize_corpus(str(corpus), tmp_path / "a", "byte", 0.25, workers=1, progress=False)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    tokenize_corpus(str(corpus), tmp_path / "a", "byte", 0.25, workers=1, progress=False)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == before
    monkeypatch.setattr(shards_mod, "MIN_UNIT_BYTES", 1)  # one shard per file: real work for 2 processes
    tokenize_corpus(str(corpus), tmp_path / "b", "byte", 0.25, workers=1, progress=False)
    tokenize_corpus(str(corpus), tmp_path / "c", "byte", 0.25, workers=2, progress=False)
    b, c = tree_bytes(tmp_path / "b"), tree_bytes(tmp_path / "c")
    assert len([k for k in b if k.endswith(".tokens")]) == 9 and b == c  # 9 non-empty files
    for split in ("train", "heldout"):  # same documents as the one-shard build
        one, many = (open_shards(tmp_path / d / split, ByteTokenizer()) for d in ("a", "b"))
        assert [d.tolist() for d in read_docs(one)] == [d.tolist() for d in read_docs(many)]
    (tmp_path / "corpus" / "new.txt").write_text("more")
    with pytest.raises(UserError, match="holds shards of other inputs"):
        tokenize_corpus(str(corpus), tmp_path / "a", "byte", 0.25, progress=False)


def write_jsonl(path, lines):
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)


def test_jsonl_documents_split_by_text_hash(tmp_path):
    texts = [f"record {i} " * (i % 5 + 1) for i in range(40)] + ["record 3 " * 4]  # one exact duplicate
    write_jsonl(tmp_path / "a.jsonl.gz", [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[:20])])
    write_jsonl(tmp_path / "b.jsonl", [json.dumps({"text": t}) for t in texts[20:]] + ["", '{"text": ""}'])
    m = tokenize_corpus(str(tmp_path / "*.jsonl*"), tmp_path / "out", "byte", 0.3, progress=False)
    tok = ByteTokenizer()
    got = {
        s: [tok.decode(d[:-1]) for d in read_docs(open_shards(tmp_path / "out" / s, tok))] for s in ("train", "heldout")
    }
    held = [t for t in texts if unit_hash(t.encode()) < 0.3]
    assert got["heldout"] == held and got["train"] == [t for t in texts if t not in held]
    assert 0 < len(held) < len(texts)
    assert m["train"]["skipped"]["empty_docs"] == 1


@pytest.mark.parametrize(
    "line, words",
    [
        ("not json", "b.jsonl:2: not a JSON object"),
        ('{"content": "x"}', "b.jsonl:2: expected a JSON object with a string 'text' field, found keys ['content']"),
        ('{"text": 3}', "b.jsonl:2: expected a JSON object"),
        ("[1, 2]", "b.jsonl:2: expected a JSON object with a string 'text' field, found list"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, words):
    write_jsonl(tmp_path / "a.jsonl", ['{"text": "fine"}'] * 3)
    write_jsonl(tmp_path / "b.jsonl", ['{"text": "fine too"}', line])
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
        tokenize_corpus(str(tmp_path), tmp_path / "out", "byte", 0.3, progress=False)
    # The failed build left nothing that looks whole.
    assert not list((tmp_path / "out").rglob("manifest.json"))
    with pytest.raises(UserError, match="no complete shard set"):
        open_shards(tmp_path / "out" / "train", ByteTokenizer())


def test_non_utf8_jsonl_line(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok too"}\n')
    with pytest.raises(UserError, match="a.jsonl:2: not UTF-8"):
        tokenize_corpus(str(tmp_path), tmp_path / "out", "byte", 0.3, progress=False)


def test_reader_refuses_mismatches_and_damage(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus)
    tokenize_corpus(str(corpus), tmp_path / "out", "byte", 0.25, progress=False)
    train = tmp_path / "out" / "train"
    with pytest.raises(UserError, match="other-v9") as err:
        open_shards(train, OtherTokenizer())
    assert ByteTokenizer().fingerprint() in str(err.value) and str(train) in str(err.value)
    with pytest.raises(UserError, match=rf"'{train}/00000.tokens' contains token id 257.*vocabulary of 200"):
        open_shards(train, ByteTokenizer(), vocab_size=200)
    data = np.memmap(train / "00000.tokens", dtype=np.uint16, mode="r+")
    data[3] = 300  # corrupt: outside the byte vocabulary
    data.flush()
    del data
    with pytest.raises(UserError, match="contains token id 300"):
        open_shards(train, ByteTokenizer())
    (train / "00000.tokens").write_bytes((train / "00000.tokens").read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated"):
        open_shards(train, ByteTokenizer())


def test_wide_vocabulary_uses_uint32(tmp_path):
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"text {i}")
    m = tokenize_corpus(str(tmp_path), tmp_path / "out", WideTokenizer(), 0.3, progress=False)
    s = open_shards(tmp_path / "out" / "train", WideTokenizer())
    assert m["train"]["dtype"] == "uint32" and s.tokens[0].dtype == np.uint32
    assert s.doc(0).tolist()[-1] == 69_999 and min(s.doc(0)) >= 65_600
