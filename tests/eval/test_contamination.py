"""Contamination check: planted n-grams found in corpora and shard sets, document boundaries,
short examples, stable hashes, clean-subset scores by hand, the CLI through its parser."""

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from lm.data.corpus import split_files
from lm.data.shards import tokenize_corpus
from lm.errors import UserError
from lm.eval import contamination_cli, ngrams
from lm.eval.contamination import check, clean_subset, table

VOCAB = [f"w{i}x" for i in range(5000)]  # nonsense words: a random 13-gram never repeats by chance


def words(seed, n):
    return list(np.random.default_rng(seed).choice(VOCAB, n))


def sentence(seed, n=20):
    return " ".join(words(seed, n))


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def eval_file(tmp_path, name="mc"):
    """Five examples of all shapes; example texts are distinct random words."""
    rows = [
        {"context": sentence(1), "choices": [sentence(2, 5), sentence(3, 5)], "answer": 1},
        {"prompt": sentence(4), "answer": sentence(5, 4)},
        "",  # blank lines count for line numbers, not as examples
        {"messages": [{"role": "user", "content": sentence(6)}, {"role": "assistant", "content": "Ok"}]},
        {"text": sentence(7, 9)},  # short: checked whole
        {"text": "Too short"},
    ]
    return write(tmp_path / f"{name}.jsonl", rows), rows


def test_planted_ngram_found_in_corpus_dir(tmp_path):
    path, rows = eval_file(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    planted = rows[1]["prompt"].split()[3:16]  # 13 words from the middle of line 2's prompt
    (corpus / "a.txt").write_text(" ".join(words(10, 3000) + [w.upper() for w in planted] + words(11, 3000)))
    (corpus / "b.txt").write_text(sentence(12, 500))
    r = check([str(corpus)], [path], progress=False)
    t = r["tasks"]["mc"]
    assert (t["examples"], t["checked"], t["too_short"], t["contaminated"], t["ids"]) == (5, 4, 1, 1, [2])
    assert t["samples"] == [{"id": 2, "ngram": " ".join(planted)}]  # lowercased, as matched
    assert t["fraction"] == pytest.approx(1 / 4)
    assert r["train"]["documents"] == 2 and r["train"]["bytes"] == sum(p.stat().st_size for p in corpus.iterdir())
    assert "mc " in table(r) and 'line 2: "' + " ".join(planted) in table(r)


def test_disjoint_text_and_document_boundaries(tmp_path):
    path, rows = eval_file(tmp_path)
    ctx = rows[0]["context"].split()
    # The context's first 13 words split over two files and over two JSONL lines: never one n-gram.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(sentence(20, 100) + " " + " ".join(ctx[:7]))
    (tmp_path / "c" / "b.txt").write_text(" ".join(ctx[7:13]) + " " + sentence(21, 100))
    write(tmp_path / "c" / "d.jsonl", [{"text": " ".join(ctx[:6])}, {"text": " ".join(ctx[6:13])}])
    (tmp_path / "c" / "e.txt").write_text(sentence(22, 5000))
    r = check([str(tmp_path / "c")], [path], progress=False)
    assert r["tasks"]["mc"]["contaminated"] == 0 and r["tasks"]["mc"]["ids"] == []
    assert r["train"]["documents"] == 5


def test_short_example_matched_whole_and_jsonl_shapes(tmp_path):
    path, rows = eval_file(tmp_path)
    short = rows[4]["text"].split()  # 9 words
    answer = rows[0]["choices"][1].split()  # the answer's text counts: context end + answer
    train = write(
        tmp_path / "train.jsonl",
        [
            {"messages": [{"role": "user", "content": " ".join(short[:8])}]},  # 8 of 9 words: no match
            {"prompt": "x", "chosen": " ".join(short), "rejected": "y"},  # all 9: a match
            {"prompt": " ".join(rows[0]["context"].split()[-8:]), "answer": " ".join(answer)},
            {"text": "too short"},
        ],
    )  # the too-short example is never checked
    t = check([train], [path], progress=False)["tasks"]["mc"]
    assert t["ids"] == [1, 5] and t["too_short"] == 1
    assert t["samples"][1] == {"id": 5, "ngram": " ".join(short)}
    assert t["samples"][0]["ngram"] == " ".join(rows[0]["context"].split()[-8:] + answer)
    with pytest.raises(UserError, match=r"bad.jsonl:2: no text"):
        check([write(tmp_path / "bad.jsonl", [{"text": "a"}, {"id": 3}])], [path], progress=False)


def test_planted_ngram_in_shard_set_train_split_only(tmp_path):
    path, rows = eval_file(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(sentence(30 + i, 300))
    files = sorted(corpus.iterdir())
    train, held = split_files(corpus, files, 0.3)
    for p in train:  # line 2's words in the train split, line 4's only in the held-out one
        p.write_text(p.read_text() + " " + rows[1]["prompt"])
    for p in held:
        p.write_text(p.read_text() + " " + rows[3]["messages"][0]["content"])
    tokenize_corpus(str(corpus), tmp_path / "shards", "byte", 0.3, workers=1, progress=False)
    r = check([str(tmp_path / "shards")], [path], progress=False)
    assert r["tasks"]["mc"]["ids"] == [2] and r["train"]["documents"] == len(train)
    both = check(
        [str(tmp_path / "shards" / "train"), str(tmp_path / "shards" / "heldout")],
        [path],
        tokenizer="byte",
        progress=False,
    )  # split dirs named directly
    assert both["tasks"]["mc"]["ids"] == [2, 4]


def test_hashes_are_stable_across_processes():
    text = "The quick brown fox, naïve café: jumps over 13 lazy dogs again and again and again!"
    code = (
        "import json, sys, numpy as np; from lm.eval import ngrams; w = ngrams.words(sys.argv[1]); "
        "h = ngrams.WordHashes().array(w); g = ngrams.ngram_hashes(h, np.zeros(len(h), int), [3, 13]); "
        "print(json.dumps({k: v[0].tolist() for k, v in g.items()}))"
    )
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, text], env=env, capture_output=True, text=True, check=True)
    h = ngrams.WordHashes().array(ngrams.words(text))
    here = ngrams.ngram_hashes(h, np.zeros(len(h), int), [3, 13])
    assert json.loads(out.stdout) == {str(k): v[0].tolist() for k, v in here.items()}
    ascii_text = "".join(map(chr, range(128))) + " Snake_case 42nd\tTAB-sep ... x"
    assert [w.decode() for w in ngrams.fast_words(ascii_text)] == ngrams.words(ascii_text)  # the same \w
    hashes = ngrams.WordHashes()
    assert (hashes.array(ngrams.fast_words(ascii_text)) == hashes.array(ngrams.words(ascii_text))).all()
    assert ngrams.fast_words(text) == ngrams.words(text)  # not ASCII: the regex
    assert len(here[3][0]) == len(h) - 2 == 14 and len(set(here[3][0].tolist())) == 13  # "again and again" x2


def fake_reports(path):
    eval_report = {
        "model": "m",
        "tasks": {
            "mc": {
                "kind": "choice",
                "path": path,
                "n": 4,
                "metrics": {"acc": 0.5},
                "example_ids": [1, 2, 4, 5],
                "per_example": {"acc": [1.0, 0.0, 1.0, 0.0], "p_answer": [0.9, 0.2, 0.6, 0.4]},
            },
            "text": {
                "kind": "lm",
                "path": path,
                "n": 3,
                "metrics": {},
                "example_ids": [1, 2, 5],
                "per_example": {"nats": [10.0, 20.0, 30.0], "bytes": [5, 10, 20], "tokens": [4, 8, 12]},
            },
            "other": {
                "kind": "choice",
                "path": "elsewhere.jsonl",
                "n": 1,
                "example_ids": [1],
                "per_example": {"acc": [1.0]},
            },
        },
    }
    contamination = {"n": 13, "tasks": {"mc": {"path": path, "ids": [2, 5]}}}
    return eval_report, contamination


def test_clean_subset_by_hand(tmp_path, monkeypatch):
    path, _ = eval_file(tmp_path)
    eval_report, contamination = fake_reports(path)
    monkeypatch.chdir(tmp_path.parent)
    for name in ("mc", "text"):  # the same file, spelled relative to where `lm eval` ran
        eval_report["tasks"][name]["path"] = os.path.relpath(path)
    clean = clean_subset(eval_report, contamination)
    assert set(clean) == {"mc", "text"}
    mc = clean["mc"]
    assert (mc["n_clean"], mc["n_contaminated"]) == (2, 2)
    assert mc["metrics_all"] == pytest.approx({"acc": 0.5, "p_answer": 0.525})
    assert mc["metrics_clean"] == pytest.approx({"acc": 1.0, "p_answer": 0.75})  # lines 1 and 4
    lm = clean["text"]  # only line 1 is clean: 10 nats, 5 bytes, 4 tokens
    assert (lm["n_clean"], lm["n_contaminated"]) == (1, 2)
    assert lm["metrics_clean"]["bits_per_byte"] == pytest.approx(10 / (math.log(2) * 5))
    assert lm["metrics_clean"]["loss"] == pytest.approx(10 / 4)
    assert lm["metrics_clean"]["perplexity"] == pytest.approx(math.exp(10 / 4))
    assert lm["metrics_all"]["bits_per_byte"] == pytest.approx(60 / (math.log(2) * 35))
    assert lm["metrics_all"]["loss"] == pytest.approx(60 / 24)
    eval_report["tasks"]["mc"]["per_example"]["acc"].pop()
    with pytest.raises(UserError, match="task 'mc': 3 'acc' scores for 4 example_ids"):
        clean_subset(eval_report, contamination)


def run_cli(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="verb")
    contamination_cli.add_parser(sub)
    return contamination_cli.run(p.parse_args(["contamination", *argv]))


def test_cli_writes_report_and_clean_scores(tmp_path, capsys):
    path, rows = eval_file(tmp_path)
    (tmp_path / "train.txt").write_text(sentence(40, 200) + " " + rows[0]["context"])
    eval_report, _ = fake_reports(path)
    (tmp_path / "eval.json").write_text(json.dumps(eval_report))
    out = tmp_path / "c.json"
    assert (
        run_cli(
            [
                "--train",
                str(tmp_path / "train.txt"),
                "--eval",
                path,
                "--report",
                str(tmp_path / "eval.json"),
                "--out",
                str(out),
                "--no-progress",
                "--n",
                "10",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["n"] == 10 and report["min_words"] == 8 and report["tasks"]["mc"]["ids"] == [1]
    assert report["clean"]["mc"]["n_contaminated"] == 1 and report["clean"]["mc"]["metrics_clean"]["acc"] == 1 / 3
    printed = capsys.readouterr().out
    assert "mc: clean 3, contaminated 1" in printed and "acc" in printed
    (tmp_path / "unrelated.json").write_text(json.dumps({"tasks": {}}))
    with pytest.raises(UserError, match="no task of it was read from the --eval files"):
        run_cli(
            [
                "--train",
                str(tmp_path / "train.txt"),
                "--eval",
                path,
                "--report",
                str(tmp_path / "unrelated.json"),
                "--no-progress",
            ]
        )


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"text": "fine words here"}, "{oops"], r"bad.jsonl:2: malformed JSON"),
        (["", "  "], r"task file '.*bad.jsonl' holds no examples"),
        ([{"text": "ok"}, {"question": "?"}], r"bad.jsonl:2: keys \['question'\]; expected \{\"context\""),
        ([{"context": "a", "choices": ["x", "y"], "answer": 2}], r"bad.jsonl:1: 'answer' is 2"),
    ],
)
def test_bad_eval_files_are_one_line_errors(tmp_path, rows, message):
    bad = write(tmp_path / "bad.jsonl", rows)
    (tmp_path / "t.txt").write_text("some training text")
    with pytest.raises(UserError, match=message) as err:
        run_cli(["--train", str(tmp_path / "t.txt"), "--eval", bad, "--no-progress"])
    assert "\n" not in str(err.value)


def test_a_file_of_examples_all_too_short_to_check_is_not_reported_as_clean(tmp_path, capsys):
    path = write(tmp_path / "short.jsonl", [{"text": "two words"}, {"prompt": "sort 3 1", "answer": "1 3"}])
    (tmp_path / "t.txt").write_text(sentence(1, 200))
    assert (
        run_cli(
            ["--train", str(tmp_path / "t.txt"), "--eval", path, "--no-progress", "--out", str(tmp_path / "c.json")]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["short", "2", "0", "0", "n/a"]
    assert lines[3].strip() == "n/a: all 2 examples are shorter than --min-words (8 words), too short to check"
    task = json.loads((tmp_path / "c.json").read_text())["tasks"]["short"]
    assert (task["checked"], task["too_short"], task["fraction"]) == (0, 2, None)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"text" + b"\0" * 3 + b"more", "a NUL byte at byte 5"),
        ("caf\u00e9 ".encode() * 3 + b"\xff\xfe", "not UTF-8 at byte 19"),  # 3 x 6 bytes, then 0xff
        (bytes(range(256)) * 40, "a NUL byte at byte 1"),
    ],
)
def test_a_binary_training_file_is_refused_naming_it(tmp_path, content, problem):
    path, _ = eval_file(tmp_path)
    (tmp_path / "random.bin").write_bytes(content)
    with pytest.raises(UserError, match=rf"--train {tmp_path / 'random.bin'}: not a text file \({problem}\)") as e:
        run_cli(["--train", str(tmp_path / "random.bin"), "--eval", path, "--no-progress"])
    assert "\n" not in str(e.value)


def test_a_character_cut_by_a_read_block_is_still_text(tmp_path):
    from lm.eval.contamination import _check_text

    (tmp_path / "t.txt").write_bytes("a\u00e9b\u20ac".encode() * 5)  # 2- and 3-byte characters across blocks
    for block in (1, 2, 3, 5):
        _check_text(tmp_path / "t.txt", block)
    (tmp_path / "cut.txt").write_bytes("ab\u20ac".encode()[:-1])  # the file ends inside a character
    with pytest.raises(UserError, match="not UTF-8 at byte 3"):
        _check_text(tmp_path / "cut.txt", 2)
