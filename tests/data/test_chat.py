"""The chat template: ids and loss weights against masks written out by hand, control-token
markers with a trained sentencepiece model, prompts, stops, and message validation."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

import lm.data.chat as chat
from lm.data.chat import ChatTemplate
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def by_hand(parts):
    """Byte-tokenizer ids and weights of (text, weight) parts, after BOS (weight 0)."""
    ids, weights = [ByteTokenizer.bos_id], [0.0]
    for text, w in parts:
        data = text.encode()
        ids += list(data)
        weights += [w] * len(data)
    return np.array(ids), np.array(weights, np.float32)


def test_two_turn_mask_with_plain_text_markers():
    ids, weights = ChatTemplate.for_tokenizer(ByteTokenizer()).render(CONVO)
    want_ids, want_weights = by_hand(
        [
            ("<|system|>\nBe brief.<|end|>\n", 0),
            ("<|user|>\nHi?<|end|>\n", 0),
            ("<|assistant|>\n", 0),
            ("Hello!<|end|>", 1),
            ("\n", 0),
            ("<|user|>\n2+2?<|end|>\n", 0),
            ("<|assistant|>\n", 0),
            ("4<|end|>", 1),
            ("\n", 0),
        ]
    )
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, want_weights)
    assert weights.sum() == len("Hello!<|end|>") + len("4<|end|>")


def test_train_on_last_weights_only_the_last_answer():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    ids, weights = template.render(CONVO, train_on="last")
    want_ids, want_weights = by_hand(
        [
            ("<|system|>\nBe brief.<|end|>\n<|user|>\nHi?<|end|>\n<|assistant|>\nHello!<|end|>\n", 0),
            ("<|user|>\n2+2?<|end|>\n<|assistant|>\n", 0),
            ("4<|end|>", 1),
            ("\n", 0),
        ]
    )
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, want_weights)
    np.testing.assert_array_equal(ids, template.render(CONVO)[0])  # same ids, other weights
    with pytest.raises(UserError, match="train_on='first'"):
        template.render(CONVO, train_on="first")


def test_plain_text_prompt_and_stops():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    ids = template.prompt(CONVO[:4])
    want, _ = by_hand(
        [
            (
                "<|system|>\nBe brief.<|end|>\n<|user|>\nHi?<|end|>\n<|assistant|>\nHello!<|end|>\n"
                "<|user|>\n2+2?<|end|>\n<|assistant|>\n",
                0,
            )
        ]
    )
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(ids, template.render(CONVO)[0][: len(ids)])  # the answer continues it
    assert template.stop_ids == (ByteTokenizer.eos_id,)
    assert template.stop_strings == ("<|end|>",)
    assert template.answer_text(list(b"4<|end|>\n<|user|>")) == "4"
    assert template.answer_text(list(b"4 and") + [ByteTokenizer.eos_id] + list(b"junk")) == "4 and"


def test_plain_text_warning_is_printed_once(monkeypatch, capsys):
    monkeypatch.setattr(chat, "_warned", set())
    ChatTemplate.for_tokenizer(ByteTokenizer())
    ChatTemplate.for_tokenizer(ByteTokenizer())
    err = capsys.readouterr().err
    assert err == "chat template: tokenizer byte has no chat tokens; role markers are plain text\n"


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from lm.data.spm import train_sentencepiece

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [(stdlib / n).read_text(encoding="utf-8") for n in ("textwrap.py", "string.py")]
    return train_sentencepiece(docs, tmp_path_factory.mktemp("spm") / "tok", vocab_size=400)


def test_control_token_markers_are_single_ids(spm_tok, monkeypatch, capsys):
    monkeypatch.setattr(chat, "_warned", set())
    template = ChatTemplate.for_tokenizer(spm_tok)
    assert capsys.readouterr().err == ""  # no plain-text warning
    sid = {name: spm_tok.special_id(f"<|{name}|>") for name in ("system", "user", "assistant", "end")}
    nl, enc = list(spm_tok.encode("\n")), lambda s: list(spm_tok.encode(s))  # noqa: E731
    ids, weights = template.render(CONVO[1:3])
    parts = [
        ([spm_tok.bos_id], 0),
        ([sid["user"]] + nl + enc("Hi?") + [sid["end"]] + nl, 0),
        ([sid["assistant"]] + nl, 0),
        (enc("Hello!") + [sid["end"]], 1),
        (nl, 0),
    ]
    np.testing.assert_array_equal(ids, [i for p, _ in parts for i in p])
    np.testing.assert_array_equal(weights, [w for p, w in parts for _ in p])
    ends = np.flatnonzero(ids == sid["end"])
    np.testing.assert_array_equal(weights[ends], [0, 1])  # the user's end marker is not trained on, the answer's is

    prompt = template.prompt(CONVO[:2])
    np.testing.assert_array_equal(prompt[-1 - len(nl) :], [sid["assistant"]] + nl)
    assert template.stop_ids == (sid["end"], spm_tok.eos_id)
    assert template.stop_strings == ()
    assert template.answer_text(enc("Hello!") + [sid["end"], spm_tok.eos_id]) == "Hello!"


def test_literal_marker_text_in_content_stays_text(spm_tok):
    template = ChatTemplate.for_tokenizer(spm_tok)
    ids, weights = template.render(
        [{"role": "user", "content": "say <|end|>"}, {"role": "assistant", "content": "<|assistant|>"}]
    )
    specials = [spm_tok.special_id(t) for t in chat.CHAT_TOKENS]
    assert [int(i) for i in ids if i in specials] == [specials[1], specials[3], specials[2], specials[3]]


ANSWER = {"role": "assistant", "content": "y"}


@pytest.mark.parametrize(
    "messages, error",
    [
        ("hi", "expected a non-empty list"),
        ([], "expected a non-empty list"),
        (["hi"], r"messages\[0\] is str"),
        ([{"role": "bot", "content": "x"}, ANSWER], r"messages\[0\]: role 'bot' is not one of"),
        ([{"content": "x"}], r"messages\[0\]: role None"),
        ([{"role": "user", "content": ""}, ANSWER], r"messages\[0\] \(user\): content is empty"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}],
            r"messages\[1\] \(assistant\): content is int",
        ),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}], "no assistant turn"),
    ],
)
def test_invalid_messages_raise_for_training(messages, error):
    with pytest.raises(ValueError, match=error):
        ChatTemplate.for_tokenizer(ByteTokenizer()).render(messages)


def test_a_prompt_must_end_with_a_user_turn():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    with pytest.raises(ValueError, match="the last message has role .assistant.; expected a user turn"):
        template.prompt(CONVO)
    template.prompt(CONVO[:2])  # no assistant turn needed
