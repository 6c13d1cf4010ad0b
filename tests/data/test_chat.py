"""The chat template: ids and loss weights against masks written out by hand, control-token
markers with a trained sentencepiece model, prompts, stops, and message validation."""

import json
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


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CONVO = [
    {"role": "user", "content": "Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "assistant", "content": "It rains."},
]


def test_tools_calls_and_results_with_plain_text_markers():
    """Tools listed in a system turn, a call as a <tool_call> block (trained), a result as a tool turn (not)."""
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    ids, weights = template.render(TOOL_CONVO, tools=[WEATHER])
    listed = "\n".join([chat.TOOLS_INTRO, json.dumps(WEATHER), chat.TOOLS_HOW])
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    want_ids, want_weights = by_hand(
        [
            (f"<|system|>\n{listed}<|end|>\n", 0),
            ("<|user|>\nParis?<|end|>\n", 0),
            ("<|assistant|>\n", 0),
            (call + "<|end|>", 1),
            ("\n<|tool|>\nrain<|end|>\n", 0),
            ("<|assistant|>\n", 0),
            ("It rains.<|end|>", 1),
            ("\n", 0),
        ]
    )
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, want_weights)
    prompt = template.prompt(TOOL_CONVO[:3], tools=[WEATHER])  # a tool's result ends a prompt
    np.testing.assert_array_equal(prompt, ids[: len(prompt)])
    assert ByteTokenizer().decode(prompt[-len("<|assistant|>\n") :]) == "<|assistant|>\n"
    system = [{"role": "system", "content": "Be brief."}]  # tools join an existing system turn
    text = ByteTokenizer().decode(template.prompt(system + TOOL_CONVO[:1], tools=[WEATHER]))
    assert text.startswith(f"<|system|>\nBe brief.\n\n{listed}<|end|>\n<|user|>\nParis?")


def test_our_calls_parse_back_with_the_servers_syntax():
    from lm.infer.serve.tools import ToolSyntax, parse

    syntax = ToolSyntax.of(ChatTemplate.source, {})
    assert syntax.renders and syntax.family.name == "hermes"
    content, calls = parse(syntax.family, "Let me look.\n" + chat.content_text(TOOL_CONVO[1]), {"weather"})
    assert content.strip() == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris"})
    ]


def test_the_tool_marker_is_one_id_and_plain_text_for_a_tokenizer_without_it(spm_tok):
    tool = spm_tok.special_id("<|tool|>")
    ids = ChatTemplate.for_tokenizer(spm_tok).prompt(TOOL_CONVO[:3])
    assert list(ids).count(tool) == 1

    class Older:  # a tokenizer trained before <|tool|> was a control token
        def __getattr__(self, name):
            return getattr(spm_tok, name)

        def special_id(self, token):
            if token == "<|tool|>":
                raise UserError("no <|tool|>")
            return spm_tok.special_id(token)

    template = ChatTemplate.for_tokenizer(Older())
    assert template.special and template.markers["user"].tolist() == [spm_tok.special_id("<|user|>")]
    assert template.markers["tool"].tolist() == list(spm_tok.encode("<|tool|>"))


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "user", "content": "x", "tool_calls": []}, r"only an assistant turn holds tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}, r"tool_calls\[0\]: expected"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
            r"tool_calls\[0\] \(f\): arguments are not JSON",
        ),
    ],
)
def test_bad_tool_turns_name_the_call(message, error):
    with pytest.raises(ValueError, match=error):
        chat.check_messages([{"role": "user", "content": "q"}, message], for_training=True)


def test_an_empty_assistant_turn_renders_its_markers_and_trains_its_end():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    ids, weights = template.render(convo)
    want = by_hand([("<|user|>\nq<|end|>\n<|assistant|>\n", 0), ("<|end|>", 1), ("\n", 0)])
    np.testing.assert_array_equal(ids, want[0])
    np.testing.assert_array_equal(weights, want[1])
    (example,) = template.examples(convo)
    np.testing.assert_array_equal(example.ids, ids)
    assert example.turns == 1 and not example.own_prefix


def test_examples_train_from_since_on():
    """A prompt-completion record: turns before `since` are context, whatever train_on says."""
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    (example,) = template.examples(CONVO, "all", since=3)
    np.testing.assert_array_equal(example.weights, template.render(CONVO, "last")[1])
    assert example.turns == 1 and template.examples(CONVO[:3], "all", since=3) == []


@pytest.mark.parametrize("tokenizer", ["bytes", "spm"])
def test_an_episode_continues_with_the_ids_of_the_next_prompt(tokenizer, spm_tok):
    """Prompt + the answer's ids (its end marker last) + the continuation = the next turn's prompt."""
    tok = ByteTokenizer() if tokenizer == "bytes" else spm_tok
    template = ChatTemplate.for_tokenizer(tok)
    convo = TOOL_CONVO[:3] + [{"role": "user", "content": "And Rome?"}]
    prompt = template.prompt(convo[:1], tools=[WEATHER])
    answer = list(tok.encode(chat.content_text(convo[1]))) + list(template.markers["end"])
    episode = np.concatenate([prompt, answer, template.continuation(convo[:2], convo[2:], tools=[WEATHER])])
    np.testing.assert_array_equal(episode, template.prompt(convo, tools=[WEATHER]))
