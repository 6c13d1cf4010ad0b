import numpy as np
import pytest

from lm.data.tokenizer import ByteTokenizer, load_tokenizer
from lm.errors import UserError


@pytest.mark.parametrize(
    "text",
    ["", "hello", "naïve café — Ελληνικά, 日本語", "emoji 🦙🚀👩‍👩‍👧", "  tabs\tand\n\nnewlines\r\n  ", "\x00nul"],
)
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert len(ids) == len(text.encode("utf-8"))
    assert ids.max(initial=0) < 256
    assert tok.decode(ids) == text


def test_bytes_input_and_specials_dropped():
    tok = ByteTokenizer()
    np.testing.assert_array_equal(tok.encode(b"ab"), [97, 98])
    ids = [tok.bos_id, 104, 105, tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(tok.encode(b"\xff")) == "\ufffd"  # invalid utf-8 is replaced, not an error


def test_ids_and_fingerprint():
    tok = load_tokenizer("byte")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.name == "byte"
    assert tok.fingerprint() == ByteTokenizer().fingerprint()
    assert isinstance(tok.fingerprint(), str) and tok.fingerprint()


def test_unknown_tokenizer():
    with pytest.raises(UserError, match="'nope'.*'byte'"):
        load_tokenizer("nope")
