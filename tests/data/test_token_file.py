import json

import numpy as np
import pytest

from lm.data.tokenizer import ByteTokenizer
from lm.data.tokens import read_token_file, write_token_file
from lm.errors import UserError


class OtherTokenizer(ByteTokenizer):
    def fingerprint(self):
        return "other-v9"


def test_round_trip(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "t.bin"
    meta = write_token_file([b"ab", "é".encode(), b""], tok, path)
    assert meta["n_tokens"] == 2 + 1 + 2 + 1 + 0 + 1
    assert (meta["n_docs"], meta["n_bytes"], meta["dtype"]) == (3, 4, "uint16")
    assert meta["tokenizer_fingerprint"] == tok.fingerprint()
    assert json.loads((tmp_path / "t.bin.json").read_text()) == meta
    tokens = read_token_file(path, tok)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, [97, 98, 257, 0xC3, 0xA9, 257, 257])
    # Only the two final files: the temp files were renamed, not left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]


def test_failed_write_leaves_old_file(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "t.bin"
    write_token_file([b"old"], tok, path)

    def docs():
        yield b"new"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_token_file(docs(), tok, path)
    assert tok.decode(read_token_file(path, tok)) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]


def test_fingerprint_mismatch(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file([b"abc"], ByteTokenizer(), path)
    with pytest.raises(UserError, match="other-v9") as err:
        read_token_file(path, OtherTokenizer())
    assert ByteTokenizer().fingerprint() in str(err.value) and str(path) in str(err.value)


def test_out_of_range_id(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "t.bin"
    write_token_file([b"abc"], tok, path)
    data = np.memmap(path, dtype=np.uint16, mode="r+")
    data[1] = 300
    data.flush()
    del data
    with pytest.raises(UserError, match=f"'{path}' contains id 300"):
        read_token_file(path, tok)


def test_missing_metadata(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file([b"abc"], ByteTokenizer(), path)
    (tmp_path / "t.bin.json").unlink()
    with pytest.raises(UserError, match="missing"):
        read_token_file(path, ByteTokenizer())


def test_truncated_file(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file([b"abc"], ByteTokenizer(), path)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated"):
        read_token_file(path, ByteTokenizer())
