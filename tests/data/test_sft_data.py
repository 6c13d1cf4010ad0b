"""SFT examples from JSONL: the formats, truncation policies and their counts, empty masks,
bad records named by file and line, the cache, and packed rows through the grain pipeline."""

import json
import re

import numpy as np
import pytest

import lm.data.sft as sft
from lm.data.pipeline import Source, eval_batches, train_dataset
from lm.data.sft import SftSettings, prepare_sft
from lm.data.shards import ShardSet
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError

BOS = ByteTokenizer.bos_id


def jsonl(path, records):
    """Writes records (dicts, or raw strings taken as lines) and returns the path."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_record(user, answer):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def by_hand(parts):
    """Byte ids and weights of BOS then (text, weight) parts."""
    ids, weights = [BOS], [0.0]
    for text, w in parts:
        ids += list(text.encode())
        weights += [w] * len(text.encode())
    return np.array(ids), np.array(weights, np.float32)


def assert_example(example, ids, weights):
    np.testing.assert_array_equal(example["inputs"], ids[:-1])
    np.testing.assert_array_equal(example["targets"], ids[1:])
    np.testing.assert_array_equal(example["loss_mask"], weights[1:])
    assert example["inputs"].dtype == example["targets"].dtype == np.int32
    assert example["loss_mask"].dtype == np.float32


def prepare(tmp_path, path, **settings):
    return prepare_sft(path, ByteTokenizer(), SftSettings(**{"seq_len": 128, **settings}), tmp_path / "cache")


def test_chat_and_instruction_formats(tmp_path):
    path = jsonl(
        tmp_path / "mixed.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo"},
                    {"role": "user", "content": "Bye"},
                    {"role": "assistant", "content": "Ciao"},
                ]
            },
            "",  # blank lines are ignored
            {"instruction": "Add", "input": "2 2", "output": "4", "system": "Calc", "id": 7},
            {"instruction": "Greet", "input": "", "output": "Hey"},
            {"instruction": "Greet", "output": "Hey"},
        ],
    )
    ex = prepare(tmp_path, path)
    assert len(ex) == 4
    assert_example(
        ex[0],
        *by_hand(
            [
                ("<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n", 0),
                ("Yo<|end|>", 1),
                ("\n<|user|>\nBye<|end|>\n<|assistant|>\n", 0),
                ("Ciao<|end|>", 1),
                ("\n", 0),
            ]
        ),
    )
    assert_example(
        ex[1],
        *by_hand(
            [("<|system|>\nCalc<|end|>\n<|user|>\nAdd\n\n2 2<|end|>\n<|assistant|>\n", 0), ("4<|end|>", 1), ("\n", 0)]
        ),
    )
    greet = by_hand([("<|user|>\nGreet<|end|>\n<|assistant|>\n", 0), ("Hey<|end|>", 1), ("\n", 0)])
    assert_example(ex[2], *greet)
    assert_example(ex[3], *greet)  # no input key = empty input
    predictions = [len(ex[i]["inputs"]) for i in range(4)]
    assert ex.stats == {
        "examples_read": 4,
        "examples_kept": 4,
        "dropped_too_long": 0,
        "truncated_prompt": 0,
        "truncated_response": 0,
        "skipped_empty_mask": 0,
        "skipped_bad_records": 0,
        "turns_trained": 5,
        "turns_own_prefix": 0,
        "response_tokens": sum(map(len, ("Yo<|end|>", "Ciao<|end|>", "4<|end|>", "Hey<|end|>" * 2))),
        "total_tokens": sum(predictions),
    }


def test_train_on_last(tmp_path):
    path = jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"},
                ]
            }
        ],
    )
    ex = prepare(tmp_path, path, train_on="last")
    assert_example(
        ex[0],
        *by_hand(
            [
                ("<|user|>\na<|end|>\n<|assistant|>\nb<|end|>\n<|user|>\nc<|end|>\n<|assistant|>\n", 0),
                ("d<|end|>", 1),
                ("\n", 0),
            ]
        ),
    )


# With the byte tokenizer an example of user content U and answer A bytes has
# 1 + (8 + 1 + U + 7 + 1) + (13 + 1 + A + 7 + 1) = U + A + 40 tokens: U + A + 39 predictions.
SHORT = chat_record("u" * 5, "a" * 5)  # 49 predictions
LONG_PROMPT = chat_record("u" * 40, "a" * 5)  # 84
LONG_ANSWER = chat_record("u" * 5, "a" * 40)  # 84


def test_drop_counts_and_skips_over_long_examples(tmp_path):
    ex = prepare(tmp_path, jsonl(tmp_path / "d.jsonl", [SHORT, LONG_PROMPT, LONG_ANSWER]), seq_len=64)
    assert len(ex) == 1 and len(ex[0]["inputs"]) == 49
    assert ex.stats["dropped_too_long"] == 2 and ex.stats["examples_kept"] == 1
    assert ex.stats["truncated_prompt"] == ex.stats["truncated_response"] == 0


def test_cut_prompt_left_keeps_the_last_tokens(tmp_path):
    ex = prepare(tmp_path, jsonl(tmp_path / "p.jsonl", [SHORT, LONG_PROMPT]), seq_len=64, truncation="cut_prompt_left")
    full = by_hand([("<|user|>\n" + "u" * 40 + "<|end|>\n<|assistant|>\n", 0), ("a" * 5 + "<|end|>", 1), ("\n", 0)])
    assert_example(ex[1], full[0][-65:], full[1][-65:])
    assert len(ex[1]["inputs"]) == 64 and ex[1]["loss_mask"].sum() == 12
    assert ex.stats["truncated_prompt"] == 1 and ex.stats["truncated_response"] == 0
    assert ex.stats["examples_kept"] == 2 and ex.stats["response_tokens"] == 12 + 12


def test_cut_response_keeps_the_first_tokens_and_skips_empty_masks(tmp_path):
    path = jsonl(tmp_path / "r.jsonl", [SHORT, LONG_ANSWER, LONG_PROMPT, SHORT])
    ex = prepare(tmp_path, path, seq_len=64, truncation="cut_response", max_skipped_fraction=0.25)
    full = by_hand([("<|user|>\nuuuuu<|end|>\n<|assistant|>\n", 0), ("a" * 40 + "<|end|>", 1), ("\n", 0)])
    assert len(ex) == 3
    assert_example(ex[1], full[0][:65], full[1][:65])
    assert ex[1]["loss_mask"].sum() == 65 - 37  # 37 prompt tokens, then answer bytes only: no end marker
    # The long prompt fills the row before its answer begins: nothing to learn, skipped and counted.
    assert ex.stats == {
        "examples_read": 4,
        "examples_kept": 3,
        "dropped_too_long": 0,
        "truncated_prompt": 0,
        "truncated_response": 1,
        "skipped_empty_mask": 1,
        "skipped_bad_records": 0,
        "turns_trained": 3,
        "turns_own_prefix": 0,
        "response_tokens": 12 + 28 + 12,
        "total_tokens": 49 + 64 + 49,
    }


def test_too_many_empty_masks_is_an_error(tmp_path):
    path = jsonl(tmp_path / "empty.jsonl", [SHORT, LONG_PROMPT, LONG_PROMPT, SHORT])
    with pytest.raises(UserError) as e:
        prepare(tmp_path, path, seq_len=64, truncation="cut_response", max_skipped_fraction=0.25)
    msg = str(e.value)
    for part in (
        str(path),
        "2 of 4 examples",
        "50.0%",
        "truncation='cut_response'",
        "seq_len=64",
        "max_skipped_fraction=0.25",
        "data.seq_len",
        "truncation policy",
    ):
        assert part in msg
    assert not list((tmp_path / "cache").glob("sft-*"))  # failed data leaves no entry


def test_no_usable_example_is_an_error(tmp_path):
    with pytest.raises(UserError, match="long.jsonl: no usable example"):
        prepare(tmp_path, jsonl(tmp_path / "long.jsonl", [LONG_PROMPT]), seq_len=64)
    with pytest.raises(UserError, match="blank.jsonl: no usable example"):
        prepare(tmp_path, jsonl(tmp_path / "blank.jsonl", ["", "  "]))
    with pytest.raises(UserError, match="missing.jsonl: no such file or folder"):
        prepare(tmp_path, tmp_path / "missing.jsonl")


BAD = [
    ('{"messages": [', "malformed JSON"),
    ("[1, 2]", "a JSON list; expected an object with 'messages'"),
    ('{"text": "hi"}', r"keys \['text'\]; expected 'messages'"),
    ('{"prompt": "x"}', r"no 'completion' \(keys: prompt\); a prompt-completion record needs"),
    ('{"prompt": 3, "completion": "y"}', r"'prompt' is int; expected a string or a list of chat messages"),
    ('{"prompt": "x", "completion": [{"role": "user", "content": "y"}]}', r"'completion': no assistant turn"),
    (
        '{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        r"messages\[0\]: role 'bot' is not one of system, user, assistant, tool",
    ),
    (
        '{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}',
        r"messages\[0\] \(user\): content is empty",
    ),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": "hi"}', "'messages' is str"),
    ('{"instruction": "x"}', "no 'output'"),
    ('{"instruction": "x", "output": 4}', "'output' is int; expected a string"),
    ('{"instruction": "", "output": "y"}', "'instruction' is empty"),
]


@pytest.mark.parametrize("line, error", BAD)
def test_bad_record_names_file_and_line(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SHORT) + "\n\n" + line + "\n" + json.dumps(SHORT) + "\n")
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:3: {error}"):
        prepare(tmp_path, path)


def test_skip_mode_counts_bad_records(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps(SHORT)] + [line for line, _ in BAD] + [json.dumps(SHORT), ""]))
    ex = prepare(tmp_path, path, on_bad_record="skip")
    assert len(ex) == 2
    assert ex.stats["skipped_bad_records"] == len(BAD)
    assert ex.stats["examples_read"] == len(BAD) + 2


def test_bad_settings_name_the_key(tmp_path):
    path = jsonl(tmp_path / "s.jsonl", [SHORT])
    with pytest.raises(UserError, match="truncation='left'; expected one of drop, cut_prompt_left, cut_response"):
        prepare(tmp_path, path, truncation="left")
    with pytest.raises(UserError, match="on_bad_record='warn'"):
        prepare(tmp_path, path, on_bad_record="warn")


def test_cache_is_reused_and_a_change_builds_a_new_entry(tmp_path, monkeypatch):
    calls = []
    tokenize = sft.tokenize_file
    monkeypatch.setattr(sft, "tokenize_file", lambda *a: calls.append(a) or tokenize(*a))
    path = jsonl(tmp_path / "c.jsonl", [SHORT, LONG_ANSWER])
    first = prepare(tmp_path, path)
    assert first.built and len(calls) == 1
    assert {p.name for p in first.path.iterdir()} == {
        "tokens.npy",
        "weights.npy",
        "offsets.npy",
        "stats.json",
        ".cache-manifest.json",
    }
    again = prepare(tmp_path, path)
    assert not again.built and len(calls) == 1  # not tokenized again
    assert again.path == first.path and again.stats == first.stats
    assert isinstance(again.tokens, np.memmap)
    copy = jsonl(tmp_path / "copy.jsonl", [SHORT, LONG_ANSWER])  # same bytes elsewhere: the same entry
    assert prepare(tmp_path, copy).path == first.path and len(calls) == 1

    other = prepare(tmp_path, path, train_on="last")  # a changed setting
    assert other.built and other.path != first.path and len(calls) == 2
    jsonl(path, [SHORT])  # changed bytes
    changed = prepare(tmp_path, path)
    assert changed.built and changed.path not in (first.path, other.path) and len(changed) == 1
    assert len(calls) == 3


def many_examples(tmp_path, n=40, seq_len=128):
    """Examples of 44 to 98 predictions, each with a unique question so rows can be traced back."""
    rng = np.random.default_rng(0)
    records = [
        {
            "messages": [{"role": "system", "content": "s"}] * (i % 2 == 0)
            + [
                {"role": "user", "content": f"q{i}:" + "u" * int(rng.integers(0, 15))},
                {"role": "assistant", "content": "a" * int(rng.integers(1, 30))},
            ]
        }
        for i in range(n)
    ]
    return prepare_sft(
        jsonl(tmp_path / "many.jsonl", records), ByteTokenizer(), SftSettings(seq_len=seq_len), tmp_path / "cache"
    )


def check_rows(batches, examples):
    """Every packed segment is one whole example, isolated, with its own loss mask; padding has none."""
    by_inputs = {tuple(examples[i]["inputs"]): examples[i] for i in range(len(examples))}
    seen = 0
    for b in batches:
        for r in range(len(b["inputs"])):
            row = {k: v[r] for k, v in b.items()}
            seg = row["segment_ids"]
            assert not row["loss_mask"][seg == 0].any()
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                assert (np.diff(where) == 1).all()
                np.testing.assert_array_equal(row["positions"][where], np.arange(len(where)))
                example = by_inputs[tuple(row["inputs"][where])]  # KeyError: not a whole example
                np.testing.assert_array_equal(row["targets"][where], example["targets"])
                np.testing.assert_array_equal(row["loss_mask"][where], example["loss_mask"])
                seen += 1
    return seen


def test_packed_sft_rows_keep_examples_whole(tmp_path):
    examples = many_examples(tmp_path)
    assert len(examples) == 40
    batches = [
        b for _, b in zip(range(12), train_dataset([Source("sft", examples, 1.0)], seq_len=128, global_batch=4, seed=0))
    ]
    assert all(b["loss_mask"].dtype == np.float32 and b["inputs"].shape == (4, 128) for b in batches)
    assert check_rows(batches, examples) > 48  # several examples share a row
    assert any((b["segment_ids"] == 0).any() for b in batches)
    assert all(b["loss_mask"].sum() < (b["segment_ids"] > 0).sum() for b in batches)  # prompts are masked
    held = eval_batches([Source("sft", examples, 1.0)], seq_len=128, batch_size=4, n_batches=3)
    check_rows(held, examples)


def test_sft_mixed_with_token_shards(tmp_path):
    examples = many_examples(tmp_path, n=12)
    shards = ShardSet(None, {}, [np.arange(10**6, 10**6 + 200, dtype=np.uint32)], [np.arange(0, 201, 20)])
    batches = [
        b
        for _, b in zip(
            range(6),
            train_dataset(
                [Source("sft", examples, 1.0), Source("web", shards, 1.0)], seq_len=128, global_batch=2, seed=1
            ),
        )
    ]
    web = np.concatenate([b["inputs"] for b in batches]) >= 10**6
    mask = np.concatenate([b["loss_mask"] for b in batches])
    assert web.any() and (mask[web] == 1).all()  # pretraining pieces keep every prediction
    sft_only = [{k: np.where(web[i * 2 : (i + 1) * 2], 0, v) for k, v in b.items()} for i, b in enumerate(batches)]
    check_rows(sft_only, examples)


def test_too_long_examples_for_the_rows_are_refused(tmp_path):
    examples = many_examples(tmp_path, n=4)
    with pytest.raises(UserError, match="up to 128 predictions, more than a row of data.seq_len=64"):
        train_dataset([Source("sft", examples, 1.0)], seq_len=64, global_batch=2, seed=0)


def test_sft_resume_is_exact(tmp_path):
    examples = many_examples(tmp_path)
    kw = dict(seq_len=128, global_batch=4, seed=3)
    straight = [b for _, b in zip(range(20), train_dataset([Source("sft", examples, 1.0)], **kw))]
    for n in (1, 9):
        it = iter(train_dataset([Source("sft", examples, 1.0)], **kw))
        [next(it) for _ in range(n)]
        state = json.loads(json.dumps(it.get_state()))
        resumed = iter(train_dataset([Source("sft", examples, 1.0)], **kw))
        resumed.set_state(state)
        for want in straight[n:]:
            got = next(resumed)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
