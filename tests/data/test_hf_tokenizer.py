"""HFTokenizer against transformers' AutoTokenizer on tokenizer directories built here (see
tests/hf_tokenizers.py): ids of real text, decoding, named ids and stops, bytes per id, errors."""

import json

import numpy as np
import pytest

from lm.data.tokenizer import ByteTokenizer, load_tokenizer
from lm.errors import UserError
from tests.hf_tokenizers import stdlib_text

pytest.importorskip("transformers")
NAMES = ["llama3_tokenizer", "qwen_tokenizer", "gemma_tokenizer"]
EXTRA = "h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001f642 caf\u00e9\t\r\n  \n\n\tx \u00a0\u2028 \ue000 ''' 12345 "
TEXTS = ["def f(x):\n    return x  # the end\n", EXTRA, "  \n\n\t  x", "\u00e9", "a" * 50, "\U0001f642\U0001f642"]


@pytest.fixture(params=NAMES)
def directory(request):
    return request.getfixturevalue(request.param)


def auto(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def test_ids_equal_transformers_on_200kb_of_text(directory):
    text = stdlib_text(200_000, skip=40) + EXTRA + "<|im_end|> <|eot_id|><end_of_turn> <bos>\u2581x"
    tok = load_tokenizer(str(directory))
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == auto(directory)(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text.encode("utf-8")).tolist() == ids.tolist()  # bytes are decoded first


@pytest.mark.parametrize("text", TEXTS + [stdlib_text(30_000, skip=7)])
def test_decode_round_trips_and_bytes_add_up(directory, text):
    tok = load_tokenizer(str(directory))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))


def test_decode_drops_special_ids(llama3_tokenizer):
    tok = load_tokenizer(str(llama3_tokenizer))
    ids = [tok.bos_id, *tok.encode("hi there"), tok.special_id("<|eot_id|>"), -1, tok.vocab_size + 5]
    assert tok.decode(ids) == "hi there"


def test_named_ids_stops_and_bos_as_transformers_adds_it(llama3_tokenizer, qwen_tokenizer, gemma_tokenizer):
    llama, qwen, gemma = (load_tokenizer(str(d)) for d in (llama3_tokenizer, qwen_tokenizer, gemma_tokenizer))
    eot, end_of_text = llama.special_id("<|eot_id|>"), llama.special_id("<|end_of_text|>")
    assert (llama.bos_id, llama.eos_id, llama.pad_id) == (llama.special_id("<|begin_of_text|>"), eot, eot)
    assert llama.stop_ids == (eot, end_of_text)  # generation_config's list, eos first
    # Qwen: no BOS although generation_config names one; pad is <|endoftext|>
    assert (qwen.bos_id, qwen.eos_id, qwen.pad_id) == (
        -1,
        qwen.special_id("<|im_end|>"),
        qwen.special_id("<|endoftext|>"),
    )
    assert (gemma.bos_id, gemma.eos_id, gemma.pad_id, gemma.stop_ids) == (2, 1, 0, (1,))
    for tok, directory in ((llama, llama3_tokenizer), (qwen, qwen_tokenizer), (gemma, gemma_tokenizer)):
        hf = auto(directory)
        assert tok.vocab_size == len(hf)
        assert tok.add_bos == (hf("a")["input_ids"][0] == tok.bos_id)
    assert (llama.add_bos, qwen.add_bos, gemma.add_bos) == (True, False, True)


def test_token_bytes_per_id(directory):
    from tokenizers import Tokenizer

    tok = load_tokenizer(str(directory))
    table = tok.token_bytes()
    assert table.dtype == np.int32 and table.shape == (tok.vocab_size,)
    assert all(table[i] == 0 for i in tok.special_tokens().values())
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    checked = 0
    for i in range(tok.vocab_size):  # every id that decodes alone to whole characters
        text = raw.decode([i], skip_special_tokens=True)
        if i not in tok.special_tokens().values() and "\ufffd" not in text:
            assert table[i] == len(text.encode("utf-8")), (i, raw.id_to_token(i))
            checked += 1
    assert checked > tok.vocab_size // 2


def test_sentencepiece_style_pieces(gemma_tokenizer):
    from tokenizers import Tokenizer

    tok, raw = load_tokenizer(str(gemma_tokenizer)), Tokenizer.from_file(str(gemma_tokenizer / "tokenizer.json"))
    table = tok.token_bytes()
    ids = tok.encode("\u65e5 a")  # no piece for the character: its three byte pieces
    assert [raw.id_to_token(int(i)) for i in ids] == ["<0xE6>", "<0x97>", "<0xA5>", "\u2581a"]
    assert table[ids].tolist() == [1, 1, 1, 2]  # "\u2581" is one space byte
    assert (table[raw.token_to_id("\u2581")], table[raw.token_to_id("\u2581return")]) == (1, 7)


def test_special_id_and_fingerprint(llama3_tokenizer, qwen_tokenizer):
    llama = load_tokenizer(str(llama3_tokenizer))
    assert llama.special_id("<|start_header_id|>") == llama.encode("<|start_header_id|>").tolist()[0]
    with pytest.raises(UserError, match="'def' is not a special or added token of .*tokenizer.json"):
        llama.special_id("def")
    fp = llama.fingerprint()
    assert fp.startswith("hf:") and len(fp) == 3 + 16
    assert fp == load_tokenizer(str(llama3_tokenizer / "tokenizer.json")).fingerprint()
    assert fp != load_tokenizer(str(qwen_tokenizer)).fingerprint()
    assert llama.name.startswith("hf-")


def test_token_bytes_is_a_method_of_every_tokenizer(llama3_tokenizer):
    from lm.eval.loglik import token_bytes

    byte = ByteTokenizer()
    assert token_bytes(byte).tolist() == [1] * 256 + [0, 0, 0]
    hf = load_tokenizer(str(llama3_tokenizer))
    np.testing.assert_array_equal(token_bytes(hf), hf.token_bytes())


def test_bad_directories_give_one_line_errors(tmp_path, llama3_tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=f"directory '{empty}' has no tokenizer.json") as e:
        load_tokenizer(str(empty))
    assert "\n" not in str(e.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=f"cannot load '{broken / 'tokenizer.json'}'") as e:
        load_tokenizer(str(broken))
    assert "\n" not in str(e.value)
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "tokenizer.json").write_bytes((llama3_tokenizer / "tokenizer.json").read_bytes())
    (bad_config / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(UserError, match="names no EOS token"):
        load_tokenizer(str(bad_config))
    with pytest.raises(UserError, match="unknown tokenizer 'nope'"):
        load_tokenizer("nope")
    assert load_tokenizer("byte").fingerprint() == ByteTokenizer().fingerprint()


def test_settings_in_the_files_as_transformers_reads_them(gemma_tokenizer, tmp_path):
    """A tokenizer.json with truncation and padding on (a plain call applies neither), and
    add_bos_token switched off in the config (ignored beside a tokenizer.json's post-processor)."""
    import shutil

    out = tmp_path / "tok"
    shutil.copytree(gemma_tokenizer, out)
    data = json.loads((out / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }
    (out / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
    tok, hf, text = load_tokenizer(str(out)), auto(out), stdlib_text(2_000)
    assert tok.encode(text).tolist() == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.add_bos is True and hf("a")["input_ids"][0] == tok.bos_id
