"""Sentencepiece BPE tokenizer: exact round trips, safe special tokens, determinism."""

import hashlib
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentencepiece")

from lm.data.spm import CHAT_TOKENS, SentencePieceTokenizer, train_sentencepiece  # noqa: E402
from lm.data.tokenizer import load_tokenizer  # noqa: E402
from lm.errors import UserError  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Whole stdlib files (all longer than sentencepiece's default 4192-byte limit).
FILES = [
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "shlex.py",
    "fnmatch.py",
    "colorsys.py",
    "keyword.py",
    "glob.py",
    "copy.py",
    "queue.py",
    "sched.py",
]
# Text the model never saw: other scripts, emoji, tabs, runs of spaces, CRLF, trailing blanks.
SAMPLES = [
    "def f(x):\n\tif x:\n\t\treturn  x * 2   \n\n\n",
    "héllo wörld — Ελληνικά, 中文, العربية, 日本語\n",
    "emoji 🎉👩‍💻🇫🇷 and ZWJ sequences\r\n",
    "    \t  \n  trailing spaces   ",
    " leading space",
    "x = {'a': [1, 2.5e-3, 0xFF]}  # comment\n",
    "",
]


# Many multi-digit numbers: without split_digits BPE would merge digit runs.
NUMBERS = "".join(f"{i * 12345 % 99991} 12345 {i}\n" for i in range(1500))


def _docs():
    return [(STDLIB / n).read_text(encoding="utf-8") for n in FILES] + [NUMBERS]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_sentencepiece(_docs(), tmp_path_factory.mktemp("spm") / "tok", vocab_size=1000)


def test_vocab_and_ids(tok):
    assert tok.vocab_size == 1000
    assert tok.train_stats["docs_used"] == len(FILES) + 1
    assert tok.train_stats["skipped_long_docs"] == 0
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert min(tok.bos_id, tok.eos_id, tok.pad_id) >= 0


@pytest.mark.parametrize("text", SAMPLES + [_docs()[0]])
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode(text.encode("utf-8")), ids)  # bytes input, same ids


def test_learned_code_pieces(tok):
    # Trained on whole files, so newline+indent runs are merged; not one id per byte.
    text = _docs()[1]
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_special_tokens_single_distinct_ids(tok):
    specials = [tok.bos_id, tok.eos_id, tok.pad_id] + [tok.special_id(t) for t in CHAT_TOKENS]
    assert len(set(specials)) == len(specials)
    body = tok.encode("hello\n")
    wrapped = [tok.bos_id, tok.special_id("<|user|>")] + list(body) + [tok.special_id("<|end|>"), tok.eos_id]
    assert tok.decode(wrapped) == "hello\n"  # specials do not leak into text
    assert tok.decode([tok.pad_id] * 3) == ""


@pytest.mark.parametrize("literal", list(CHAT_TOKENS) + ["<s>", "</s>", "<pad>", "<unk>", "a<|user|>b"])
def test_literal_special_strings_are_plain_text(tok, literal):
    specials = {tok.bos_id, tok.eos_id, tok.pad_id} | {tok.special_id(t) for t in CHAT_TOKENS}
    ids = tok.encode(literal)
    assert not specials & set(ids.tolist())
    assert tok.decode(ids) == literal


def test_digits_split(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_id_missing_names_token(tok):
    with pytest.raises(UserError, match=re.escape("<|nope|>")):
        tok.special_id("<|nope|>")


def test_retrain_is_byte_identical(tok, tmp_path):
    again = train_sentencepiece(_docs(), tmp_path / "again", vocab_size=1000)
    assert again.path.read_bytes() == tok.path.read_bytes()
    assert again.fingerprint() == tok.fingerprint()
    assert tok.path.with_suffix(".vocab").is_file()
    assert not list(tmp_path.glob("*.tmp-*"))  # atomic write left no temp files


def test_model_bytes_do_not_depend_on_thread_count(tok, tmp_path):
    one = train_sentencepiece(_docs(), tmp_path / "one", vocab_size=1000, num_threads=1)
    two = train_sentencepiece(_docs(), tmp_path / "two", vocab_size=1000, num_threads=2)
    assert one.path.read_bytes() == two.path.read_bytes()


def test_fingerprint_tracks_model_bytes(tok, tmp_path):
    assert tok.fingerprint() == "spm:" + hashlib.sha256(tok.path.read_bytes()).hexdigest()[:16]
    other = train_sentencepiece(_docs(), tmp_path / "small", vocab_size=700)
    assert other.fingerprint() != tok.fingerprint()


def test_long_document_counted_not_silently_dropped(tmp_path):
    docs = _docs()
    # "é" only appears in this ~20 kB doc (well over sentencepiece's 4192 default):
    # it becomes a single piece only if the doc really was trained on.
    long_doc = ("café résumé naïve " * 1200)[:20_000]
    too_long = "x" * 30_001
    stats_tok = train_sentencepiece(docs + [long_doc, too_long], tmp_path / "t", vocab_size=600, max_doc_bytes=30_000)
    assert stats_tok.train_stats["skipped_long_docs"] == 1
    assert stats_tok.train_stats["docs_used"] == len(docs) + 1
    assert len(stats_tok.encode("é")) == 1


def test_max_bytes_caps_input(tmp_path):
    docs = _docs()
    cap = sum(len(d.encode()) for d in docs[:6])
    t = train_sentencepiece(docs, tmp_path / "cap", vocab_size=600, max_bytes=cap)
    assert t.train_stats["docs_used"] == 6 and t.train_stats["hit_max_bytes"]
    assert t.train_stats["bytes_used"] <= cap


def test_vocab_too_small_is_user_error(tmp_path):
    with pytest.raises(UserError, match="vocab_size=100"):
        train_sentencepiece(_docs()[:2], tmp_path / "tiny", vocab_size=100)


def test_load_tokenizer_model_path(tok):
    loaded = load_tokenizer(str(tok.path))
    assert isinstance(loaded, SentencePieceTokenizer)
    assert loaded.fingerprint() == tok.fingerprint()
    assert np.array_equal(loaded.encode(SAMPLES[0]), tok.encode(SAMPLES[0]))
    assert "/" not in loaded.name  # used in cache directory names


def test_load_tokenizer_missing_path(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(UserError, match="nope.model") as e:
        load_tokenizer(str(missing))
    assert "'byte'" in str(e.value)
    with pytest.raises(UserError, match="unknown tokenizer"):
        load_tokenizer("bpe")


def test_foreign_model_without_pad_or_chat_tokens(tmp_path):
    # Like Llama-2's tokenizer.model: pad_id == -1 and no chat-role tokens.
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_docs()[:3]),
        model_prefix=str(tmp_path / "llama"),
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        pad_id=-1,
        max_sentence_length=1 << 20,
        minloglevel=2,
    )
    t = SentencePieceTokenizer(tmp_path / "llama.model")
    assert 0 <= t.pad_id < t.vocab_size  # mapped to a valid id (unk), never -1
    assert (t.bos_id, t.eos_id) == (1, 2)
    with pytest.raises(UserError, match=r"<\|user\|>"):
        t.special_id("<|user|>")
