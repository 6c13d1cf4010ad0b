"""Preference pairs from JSONL: masks of both sides against hand-built ids, prompt forms, bad
records named by file and line or counted, over-long pairs, the cache, the stats invariant."""

import json

import numpy as np
import pytest

from lm.data.preference import pair_conversations, prepare_pairs
from lm.data.sft import SftSettings
from lm.data.synthetic import is_correct, sort_pairs
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from tests.data.test_sft_data import by_hand, jsonl


def prepare(tmp_path, path, **settings):
    return prepare_pairs(path, ByteTokenizer(), SftSettings(**{"seq_len": 96, **settings}), tmp_path / "cache")


def assert_side(pair, side, ids, weights, seq_len=96):
    n = len(ids) - 1
    np.testing.assert_array_equal(pair["inputs"][side, :n], ids[:-1])
    np.testing.assert_array_equal(pair["targets"][side, :n], ids[1:])
    np.testing.assert_array_equal(pair["loss_mask"][side, :n], weights[1:])
    np.testing.assert_array_equal(pair["segment_ids"][side], (np.arange(seq_len) < n).astype(np.int32))
    np.testing.assert_array_equal(pair["positions"][side, :n], np.arange(n))
    assert not pair["loss_mask"][side, n:].any() and not pair["positions"][side, n:].any()


def invariant(s):
    return (
        s["pairs_read"]
        == s["pairs_kept"]
        + s["dropped_too_long"]
        + s["skipped_identical"]
        + s["skipped_empty_mask"]
        + s["skipped_bad_records"]
    )


def test_both_sides_masked_on_the_response_only(tmp_path):
    multi = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    path = jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "sort 21", "chosen": "12", "rejected": "21", "margin": 0.5},
            {"prompt": multi, "chosen": [{"role": "assistant", "content": "Y"}], "rejected": "N"},
            {"prompt": "sort 21", "chosen": [{"role": "assistant", "content": "12"}], "rejected": "21"},
        ],
    )
    ex = prepare(tmp_path, path)
    assert len(ex) == 3 and float(ex[0]["margin"]) == 0.5 and float(ex[1]["margin"]) == 0.0
    head = "<|user|>\nsort 21<|end|>\n<|assistant|>\n"
    assert_side(ex[0], 0, *by_hand([(head, 0), ("12<|end|>", 1), ("\n", 0)]))
    assert_side(ex[0], 1, *by_hand([(head, 0), ("21<|end|>", 1), ("\n", 0)]))
    turns = "<|user|>\na<|end|>\n<|assistant|>\nb<|end|>\n<|user|>\nc<|end|>\n<|assistant|>\n"
    assert_side(ex[1], 0, *by_hand([(turns, 0), ("Y<|end|>", 1), ("\n", 0)]))  # earlier answer: no loss
    for k in ("inputs", "loss_mask", "segment_ids"):
        np.testing.assert_array_equal(ex[2][k], ex[0][k])  # TRL's conversational form == strings
    s = ex.stats
    assert s["pairs_kept"] == 3 and s["chosen_tokens"] == len("12<|end|>Y<|end|>12<|end|>") and invariant(s)


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"prompt": "p", "chosen": "a"}', "no 'rejected'"),
        ('{"prompt": "p", "chosen": "", "rejected": "b"}', "'chosen' is empty"),
        ('{"prompt": 3, "chosen": "a", "rejected": "b"}', "'prompt' is int"),
        ('{"prompt": "p", "chosen": "a", "rejected": "a"}', "identical"),
        ('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "x"}', "'margin'"),
        ('{"prompt": "p", "chosen": "a", ', "malformed JSON"),
    ],
)
def test_bad_records_name_file_and_line_or_are_counted(tmp_path, line, reason):
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(UserError, match=rf"bad.jsonl:2: .*{reason}"):
        prepare(tmp_path, path)
    s = prepare(tmp_path, path, on_bad_record="skip").stats
    counted = "skipped_identical" if reason == "identical" else "skipped_bad_records"
    assert s[counted] == 1 and s["pairs_kept"] == 1 and invariant(s)


def test_over_long_pairs_are_dropped_or_cut_and_counted(tmp_path):
    path = jsonl(
        tmp_path / "long.jsonl",
        [{"prompt": "p", "chosen": "x" * 80, "rejected": "y"}, {"prompt": "p", "chosen": "a", "rejected": "b"}],
    )
    s = prepare(tmp_path, path, max_skipped_fraction=1.0).stats
    assert s["dropped_too_long"] == 1 and s["pairs_kept"] == 1 and invariant(s)
    cut = prepare(tmp_path, path, truncation="cut_response", seq_len=64)
    assert cut.stats["truncated_response"] == 1 and len(cut) == 2
    assert cut[0]["segment_ids"][0].sum() == 64  # cut to seq_len predictions
    long_prompt = jsonl(tmp_path / "lp.jsonl", [{"prompt": "q" * 80, "chosen": "a", "rejected": "b"}])
    with pytest.raises(UserError, match="max_skipped_fraction"):
        prepare(tmp_path, long_prompt, truncation="cut_response", seq_len=64)


def test_empty_file_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="empty.jsonl: no usable pair"):
        prepare(tmp_path, jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(UserError, match="nope.jsonl: no such file or folder; expected .* holding preference pairs$"):
        prepare(tmp_path, tmp_path / "nope.jsonl")


def test_cache_is_reused_and_rebuilt_when_inputs_change(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert prepare(tmp_path, path).built and not prepare(tmp_path, path).built
    assert prepare(tmp_path, path, seq_len=64).built
    jsonl(path, [{"prompt": "p", "chosen": "a", "rejected": "c"}])
    assert prepare(tmp_path, path).built


def test_sort_pairs_and_their_reference_conversations(tmp_path):
    rows = sort_pairs(50, heldout=True, seed=0)
    assert all(is_correct(r["prompt"], r["chosen"]) and not is_correct(r["prompt"], r["rejected"]) for r in rows)
    path = jsonl(tmp_path / "s.jsonl", rows)
    conversations = pair_conversations(path, limit=3)
    assert [c[-1]["content"] for c in conversations] == [r["chosen"] for r in rows[:3]]
