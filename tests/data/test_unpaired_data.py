"""Unpaired examples for KTO: each example rendered as prompt + completion with its twin (its
prompt with the completion before it), labels as 1/0, bad records named by file and line or
counted, over-long twins cut, pairs split into unpaired examples."""

import json

import numpy as np
import pytest

from lm.data.chat import ChatTemplate
from lm.data.sft import SftSettings
from lm.data.tokenizer import ByteTokenizer
from lm.data.unpaired import prepare_unpaired, unpaired_from_pairs
from lm.errors import UserError
from tests.data.test_preference_data import assert_side
from tests.data.test_sft_data import jsonl

RECORDS = [
    {"prompt": "sort 31", "completion": "13", "label": True},
    {
        "prompt": [{"role": "user", "content": "sort 2"}],
        "completion": [{"role": "assistant", "content": "22"}],
        "label": False,
    },
    {"prompt": "sort 705", "completion": "057", "label": True},
]


def prepare(tmp_path, path, **settings):
    return prepare_unpaired(path, ByteTokenizer(), SftSettings(**{"seq_len": 96, **settings}), tmp_path / "cache")


def rendered(prompt: str, completion: str):
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    return template.render([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], "last")


def test_each_example_has_its_twin_and_label(tmp_path):
    rows = prepare(tmp_path, jsonl(tmp_path / "u.jsonl", RECORDS))
    assert len(rows) == 3 and rows.stats["desirable"] == 2 and rows.stats["undesirable"] == 1
    prompts, completions = ["sort 31", "sort 2", "sort 705"], ["13", "22", "057"]
    for i in range(3):
        assert_side(rows[i], 0, *rendered(prompts[i], completions[i]))
        assert_side(rows[i], 1, *rendered(prompts[i], completions[i - 1]))  # the first takes the last's
    assert [float(rows[i]["label"]) for i in range(3)] == [1.0, 0.0, 1.0] and "margin" not in rows[0]


def test_bad_labels_are_one_line_naming_file_and_line_or_counted(tmp_path):
    bad = jsonl(tmp_path / "bad.jsonl", [RECORDS[0], {"prompt": "p", "completion": "c", "label": 1}])
    with pytest.raises(UserError, match=r"bad.jsonl:2: .*'label' is 1; expected true \(desirable\) or false"):
        prepare(tmp_path, bad)
    missing = jsonl(tmp_path / "missing.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(UserError, match=r"missing.jsonl:1: .*no 'label'"):
        prepare(tmp_path, missing)
    rows = prepare(tmp_path, bad, on_bad_record="skip", max_skipped_fraction=0.5)
    assert rows.stats["skipped_bad_records"] == 1 and rows.stats["examples_kept"] == 1


def test_a_twin_longer_than_the_rows_is_cut_and_one_with_no_completion_left_is_empty(tmp_path):
    digits = "9" * 40
    records = [
        {"prompt": "sort 1", "completion": digits, "label": True},
        {"prompt": "x" * 40, "completion": "1", "label": False},
    ]
    rows = prepare(tmp_path, jsonl(tmp_path / "u.jsonl", records))
    assert rows.stats["twins_cut"] == 1  # "x" * 40 followed by the 40 digits
    assert rows[1]["loss_mask"][1].sum() > 0 and rows[1]["segment_ids"][1].sum() == 96
    # a prompt cut from the left keeps its example; its twin, cut at the end, keeps no completion token
    records[1]["prompt"] = "x" * 100
    rows = prepare(tmp_path, jsonl(tmp_path / "v.jsonl", records), truncation="cut_prompt_left")
    assert rows.stats["twins_empty"] == 1 and rows[1]["loss_mask"][1].sum() == 0
    assert rows[1]["loss_mask"][0].sum() > 0


def test_pairs_split_into_unpaired_examples(tmp_path):
    pairs = jsonl(tmp_path / "p.jsonl", [{"prompt": "sort 31", "chosen": "13", "rejected": "31"}])
    assert unpaired_from_pairs(pairs, tmp_path / "u.jsonl") == 2
    lines = [json.loads(line) for line in (tmp_path / "u.jsonl").read_text().splitlines()]
    assert lines == [
        {"prompt": [{"role": "user", "content": "sort 31"}], "completion": "13", "label": True},
        {"prompt": [{"role": "user", "content": "sort 31"}], "completion": "31", "label": False},
    ]
    assert np.array_equal(prepare(tmp_path, tmp_path / "u.jsonl")[0]["label"], np.float32(1.0))
