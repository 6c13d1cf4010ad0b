"""Task specs, generation scorers, the report's bootstrap comparison, and `lm eval` end to end."""

import json

import numpy as np
import pytest

from lm.cli import main
from lm.errors import UserError
from lm.eval import generation, report, tasks
from lm.eval.taskfile import read_task_file


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_task_kind_follows_the_data(tmp_path):
    mc = write(tmp_path / "mc.jsonl", [{"context": "2+2=", "choices": ["4", "5"], "answer": 0}])
    gen = write(tmp_path / "gen.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    text = write(tmp_path / "text.jsonl", [{"text": "hello"}])
    assert tasks.parse_task(str(mc)).kind == "choice"
    assert tasks.parse_task(f"g={gen}?scorer=normalized&max_new_tokens=8").options == {
        "scorer": "normalized",
        "max_new_tokens": 8,
    }
    assert tasks.parse_task(str(text)).kind == "lm" and tasks.parse_task(str(text)).name == "text"
    assert tasks.parse_task(str(tmp_path)).kind == "lm"
    with pytest.raises(UserError, match="unknown option 'shot'"):
        tasks.parse_task(f"{mc}?shot=2")
    with pytest.raises(UserError, match="not an int"):
        tasks.parse_task(f"{mc}?shots=two")


def test_bad_task_lines_name_file_and_line(tmp_path):
    bad = write(tmp_path / "bad.jsonl", [{"context": "a", "choices": ["x", "y"], "answer": 0}, "{oops"])
    with pytest.raises(UserError, match=r"bad.jsonl:2: malformed JSON"):
        read_task_file(bad)
    from lm.eval.choice import parse_choice

    with pytest.raises(UserError, match="f:3: 'answer' is 7"):
        parse_choice({"context": "a", "choices": ["x", "y"], "answer": 7}, "f:3")
    assert parse_choice({"context": "a", "choices": ["x", "y"], "answer": "y"}, "f:1")["answer"] == 1
    with pytest.raises(UserError, match="holds no examples"):
        read_task_file(write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(UserError, match="must end with an assistant turn"):
        generation.parse_generation({"messages": [{"role": "user", "content": "hi"}]}, "f:1")


def test_generation_scorers_by_hand(tmp_path):
    ex = {"answers": ["The Cat sat."], "record": {"answer": "The Cat sat.", "n": 3}}
    assert generation.make_scorer("exact")(" The Cat sat. ", ex) == 1.0
    assert generation.make_scorer("exact")("the cat sat", ex) == 0.0
    assert generation.make_scorer("normalized")("cat   sat", ex) == 1.0  # case, punctuation, articles
    # ROUGE-L F: LCS "the cat" of 2 tokens over 3 (reference) and 2 (prediction) -> 2PR/(P+R) = 0.8
    assert generation.make_scorer("rouge_l")("the cat", ex) == pytest.approx(0.8)
    assert generation.make_scorer("bleu")("The Cat sat.", ex) == pytest.approx(1.0)
    check = tmp_path / "check.py"
    check.write_text("def has_n(prediction, example):\n    return str(example['n']) in prediction\n")
    assert generation.make_scorer("checker", f"{check}:has_n")("3 cats", ex) == 1.0
    with pytest.raises(UserError, match="scorer 'blue'"):
        generation.make_scorer("blue")


def entry(kind, per, ids=None):
    n = len(next(iter(per.values())))
    return {"kind": kind, "n": n, "per_example": per, "example_ids": ids or list(range(1, n + 1)), "metrics": {}}


def test_compare_gives_the_difference_and_a_paired_bootstrap_interval():
    a = {"tasks": {"t": entry("generation", {"exact": [0.0, 1.0] * 50})}}
    same = report.compare(a, a, rounds=200)["t"]["exact"]
    assert same["diff"] == 0.0 and same["ci95"] == (0.0, 0.0) and same["paired"]
    b = {"tasks": {"t": entry("generation", {"exact": [1.0, 1.0] * 50})}}
    r = report.compare(a, b, rounds=200)["t"]["exact"]
    assert r["diff"] == pytest.approx(0.5) and 0.35 < r["ci95"][0] < 0.5 < r["ci95"][1] < 0.65


def test_compare_language_modelling_recomputes_bits_per_byte_per_resample():
    per = {"nats": [10.0, 30.0], "tokens": [5, 10], "text_nats": [8.0, 24.0], "bytes": [4, 12]}
    e = entry("lm", per)
    assert report.metric(e, "bits_per_byte") == pytest.approx(32 / np.log(2) / 16)
    assert report.metric(e, "loss", [1, 1]) == pytest.approx(3.0)  # doc 2 twice: 60 nats / 20 tokens


@pytest.mark.slow
def test_lm_eval_cli_end_to_end(small_base, tmp_path, capsys):
    mc = write(
        tmp_path / "mc.jsonl",
        [{"context": f"def f{i}(x):", "choices": ["\n    return x", "\n\n\n"], "answer": 0} for i in range(6)],
    )
    gen = write(tmp_path / "gen.jsonl", [{"prompt": "import o", "answer": "s"}, {"prompt": "def", "answer": " f"}])
    text = write(tmp_path / "held.jsonl", [{"text": "def add(a, b):\n    return a + b\n"}] * 3)
    out = tmp_path / "r.json"
    args = [
        "eval",
        "--workdir",
        str(small_base),
        "--no-progress",
        "--out",
        str(out),
        "--tasks",
        f"held={text}",
        f"mc={mc}?shots=2",
        f"gen={gen}?chat=false&max_new_tokens=4&scorer=normalized",
    ]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert set(r["tasks"]) == {"held", "mc", "gen"}
    assert 0 < r["tasks"]["held"]["metrics"]["bits_per_byte"] < 9
    assert r["tasks"]["mc"]["n"] == 6 and len(r["tasks"]["gen"]["per_example"]["normalized"]) == 2
    assert "bits_per_byte" in capsys.readouterr().out
    again = tmp_path / "r8.json"  # the same report on a (4,2,1) mesh of the simulated devices
    assert (
        main(
            [
                "eval",
                "--workdir",
                str(small_base),
                "--no-progress",
                "--out",
                str(again),
                "--tasks",
                f"held={text}",
                "--config.mesh.data=4",
                "--config.mesh.fsdp=2",
            ]
        )
        == 0
    )
    assert json.loads(again.read_text())["tasks"]["held"]["metrics"]["bits_per_byte"] == pytest.approx(
        r["tasks"]["held"]["metrics"]["bits_per_byte"], rel=1e-5
    )
    assert main(["eval", "--compare", str(out), str(out)]) == 0
    assert "B - A" in capsys.readouterr().out
    # example 1 of mc.jsonl planted in a training file: 5 words, checked whole with --min-words 3
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.py").write_text("x = 1\ndef f0(x):\n    return x\n")
    cont = tmp_path / "c.json"
    assert (
        main(
            [
                "contamination",
                "--train",
                str(tmp_path / "train"),
                "--eval",
                str(mc),
                "--min-words",
                "3",
                "--report",
                str(out),
                "--out",
                str(cont),
                "--no-progress",
            ]
        )
        == 0
    )
    c = json.loads(cont.read_text())
    assert c["tasks"]["mc"]["ids"] == [1] and c["clean"]["mc"]["n_clean"] == 5
    clean_acc = np.mean(r["tasks"]["mc"]["per_example"]["acc"][1:])
    assert c["clean"]["mc"]["metrics_clean"]["acc"] == pytest.approx(clean_acc)
    assert main(["eval", "--workdir", str(small_base), "--tasks", f"{mc}?shots=9"]) == 2
    assert "9 shots need more than 9 examples" in capsys.readouterr().err
    assert main(["eval", "--compare", str(out), str(tmp_path / "nope.json")]) == 2
