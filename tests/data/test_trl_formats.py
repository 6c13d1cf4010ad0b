"""TRL's dataset formats in every fine-tuning reader, from every form of records file: SFT
(conversational, prompt-completion, conversational prompt-completion), preference pairs (explicit
and implicit prompt), prompts for RL, and unpaired examples. Each form gives the same tokenized
examples as JSONL."""

import re

import numpy as np
import pytest

from lm.data.chat import ChatTemplate
from lm.data.preference import prepare_pairs
from lm.data.prompts import read_prompts
from lm.data.sft import SftSettings, prepare_sft
from lm.data.tokenizer import ByteTokenizer
from lm.data.unpaired import prepare_unpaired
from lm.errors import UserError
from tests.data.forms import FORMS, write

pytest.importorskip("pyarrow")


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONAL = [
    {"messages": [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Yo")]},
    {"messages": [msg("user", "2+2?"), msg("assistant", "4"), msg("user", "3+3?"), msg("assistant", "6")]},
]
PROMPT_COMPLETION = [{"prompt": "Hi", "completion": "Yo"}, {"prompt": "2+2?", "completion": "4"}]
CONVERSATIONAL_PROMPT_COMPLETION = [
    {"prompt": [msg("user", "Hi")], "completion": [msg("assistant", "Yo")]},
    {
        "prompt": [msg("user", "2+2?"), msg("assistant", "4"), msg("user", "3+3?")],
        "completion": [msg("assistant", "6")],
    },
]
PAIRS = [  # a column holds one type: strings here, messages below
    {"prompt": "sort 21", "chosen": "12", "rejected": "21"},
    {"prompt": "sort 31", "chosen": "13", "rejected": "31", "margin": 0.5},
]
CONVERSATIONAL_PAIRS = [
    {"prompt": [msg("user", "sort 21")], "chosen": [msg("assistant", "12")], "rejected": [msg("assistant", "21")]},
    {"prompt": [msg("user", "sort 31")], "chosen": [msg("assistant", "13")], "rejected": [msg("assistant", "31")]},
]
IMPLICIT = [
    {
        "chosen": [msg("user", "sort 21"), msg("assistant", "12")],
        "rejected": [msg("user", "sort 21"), msg("assistant", "21")],
    },
    {
        "chosen": [msg("user", "sort 31"), msg("assistant", "13")],
        "rejected": [msg("user", "sort 31"), msg("assistant", "31")],
    },
]
UNPAIRED = [
    {"prompt": "sort 31", "completion": "13", "label": True},
    {"prompt": "sort 705", "completion": "705", "label": False},
]
PROMPTS = [{"prompt": "sort 31", "answer": "13"}, {"prompt": "sort 705", "answer": "057"}]
CHAT_PROMPTS = [{"prompt": [msg("system", "Sort."), msg("user", "31")], "answer": "13"}]


def settings(**kw):
    return SftSettings(**{"seq_len": 96, **kw})


def sft(tmp_path, path, **kw):
    return prepare_sft(path, ByteTokenizer(), settings(**kw), tmp_path / "cache")


def rows(examples):
    return [{k: v.tolist() for k, v in examples[i].items()} for i in range(len(examples))]


@pytest.mark.parametrize(
    "records", [CONVERSATIONAL, PROMPT_COMPLETION, CONVERSATIONAL_PROMPT_COMPLETION], ids=["conv", "pc", "conv_pc"]
)
def test_sft_forms_give_the_examples_of_jsonl(tmp_path, records):
    want = sft(tmp_path, write(records, tmp_path / "jsonl", "jsonl"))
    for form in FORMS[1:]:
        got = sft(tmp_path, write(records, tmp_path / form, form))
        assert rows(got) == rows(want), form
        assert got.stats == want.stats


def test_prompt_completion_trains_the_completion_only(tmp_path):
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    plain = sft(tmp_path, write(PROMPT_COMPLETION, tmp_path / "pc", "parquet"))
    conv = sft(tmp_path, write(CONVERSATIONAL_PROMPT_COMPLETION, tmp_path / "conv", "parquet"))
    assert rows(plain)[0] == rows(conv)[0]  # a string is one user turn, or one assistant turn
    convo = CONVERSATIONAL_PROMPT_COMPLETION[1]["prompt"] + CONVERSATIONAL_PROMPT_COMPLETION[1]["completion"]
    ids, weights = template.render(convo, "last")  # the prompt's own answer "4" is context
    np.testing.assert_array_equal(conv[1]["loss_mask"], weights[1:])
    np.testing.assert_array_equal(conv[1]["inputs"], ids[:-1])
    trained_all = sft(tmp_path, write(CONVERSATIONAL, tmp_path / "all", "parquet"))
    assert trained_all[1]["loss_mask"].sum() > conv[1]["loss_mask"].sum()  # "messages" trains both answers
    assert conv.stats["turns_trained"] == 2 and trained_all.stats["turns_trained"] == 3


def pairs(tmp_path, path):
    return prepare_pairs(path, ByteTokenizer(), settings(), tmp_path / "cache")


@pytest.mark.parametrize("records", [PAIRS, CONVERSATIONAL_PAIRS, IMPLICIT], ids=["explicit", "conv", "implicit"])
def test_pair_forms_give_the_pairs_of_jsonl(tmp_path, records):
    want = pairs(tmp_path, write(records, tmp_path / "jsonl", "jsonl"))
    for form in FORMS[1:]:
        got = pairs(tmp_path, write(records, tmp_path / form, form))
        assert rows(got) == rows(want) and got.stats == want.stats, form


def test_an_implicit_prompt_is_the_shared_start(tmp_path):
    implicit = pairs(tmp_path, write(IMPLICIT, tmp_path / "i", "parquet"))
    assert rows(implicit) == rows(pairs(tmp_path, write(CONVERSATIONAL_PAIRS, tmp_path / "e", "jsonl")))
    longer = {  # a shared multi-turn start: every shared message is the prompt
        "chosen": [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")],
        "rejected": [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "e")],
    }
    split = {"prompt": longer["chosen"][:3], "chosen": "d", "rejected": "e"}
    one = pairs(tmp_path, write([longer], tmp_path / "l", "jsonl"))
    assert rows(one) == rows(pairs(tmp_path, write([split], tmp_path / "s", "jsonl")))


@pytest.mark.parametrize(
    "record, error",
    [
        ({"chosen": "12", "rejected": "21"}, r"no 'prompt', and 'chosen' is str; a pair needs 'prompt', or 'chosen'"),
        (
            {
                "chosen": [msg("user", "a"), msg("assistant", "b")],
                "rejected": [msg("user", "x"), msg("assistant", "b")],
            },
            r"no 'prompt', and 'chosen' and 'rejected' differ from their first message",
        ),
        (
            {
                "chosen": [msg("user", "a"), msg("assistant", "b"), msg("user", "c")],
                "rejected": [msg("user", "a"), msg("assistant", "d")],
            },
            r"'chosen' goes on after the implicit prompt with 2 messages \(roles: assistant, user\); expected one",
        ),
        (
            {"chosen": [msg("user", "a"), msg("assistant", "b")], "rejected": [msg("user", "a")]},
            r"'rejected' goes on after the implicit prompt with 0 messages",
        ),
        ({"chosen": [msg("user", "a")], "rejected": ["x"]}, r"'rejected': messages\[0\] is str"),
    ],
)
def test_bad_implicit_pairs_name_file_row_and_key(tmp_path, record, error):
    try:
        path = write([IMPLICIT[0], record], tmp_path, "parquet")
    except Exception:  # a column of mixed types (a string among conversations): JSONL only
        path = write([IMPLICIT[0], record], tmp_path, "jsonl")
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:2: {error}"):
        pairs(tmp_path, path)


def test_identical_implicit_sides_are_counted_as_identical(tmp_path):
    same = {"chosen": IMPLICIT[0]["chosen"], "rejected": IMPLICIT[0]["chosen"]}
    path = write(IMPLICIT + [same], tmp_path, "parquet")
    got = prepare_pairs(path, ByteTokenizer(), settings(on_bad_record="skip"), tmp_path / "cache")
    assert got.stats["skipped_identical"] == 1 and len(got) == 2


def test_unpaired_forms_give_the_examples_of_jsonl(tmp_path):
    def unpaired(path):
        return prepare_unpaired(path, ByteTokenizer(), settings(), tmp_path / "cache")

    want = unpaired(write(UNPAIRED, tmp_path / "jsonl", "jsonl"))
    for form in FORMS[1:]:
        got = unpaired(write(UNPAIRED, tmp_path / form, form))
        assert rows(got) == rows(want) and got.stats == want.stats, form


@pytest.mark.parametrize("records", [PROMPTS, CHAT_PROMPTS], ids=["text", "conversational"])
def test_prompt_forms_give_the_prompts_of_jsonl(tmp_path, records):
    def prompts(path):
        return read_prompts(path, ByteTokenizer(), seq_len=96, max_new_tokens=16)

    want = prompts(write(records, tmp_path / "jsonl", "jsonl"))
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    assert want.tokens(0) == template.prompt(want.messages[0]).tolist() and want.columns[0] == {"answer": "13"}
    for form in FORMS[1:]:
        got = prompts(write(records, tmp_path / form, form))
        assert got.ids.tolist() == want.ids.tolist() and got.prompts == want.prompts, form
        assert got.messages == want.messages and got.columns == want.columns, form
