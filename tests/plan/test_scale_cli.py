"""`lm scale`: the family rule, --print-commands, one-line errors, finished points read back (never
retrained), and a small ladder end to end through the CLI with an interrupted point resumed."""

import json
import pathlib
import shlex

import numpy as np
import pytest

from lm.cli import _split_overrides, main
from lm.config import load_config
from lm.model import counts
from lm.plan.scale import ladder_points, point_config, shape
from lm.plan.scaling_fit import Law

TINY = "configs/tiny.py"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_family_rule_keeps_head_dim_and_ratios():
    m = load_config(TINY).model  # d_model 128, 4 heads of 32, 2 kv heads, d_ff 384
    assert shape(m, 128, 4) == dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384)
    assert shape(m, 64, 2) == dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=192)
    assert shape(m, 96, 3) == dict(d_model=96, n_layers=3, n_heads=3, n_kv_heads=1, d_ff=288)
    assert shape(m, 256, 2)["n_kv_heads"] == 4
    c = load_config(TINY)
    for w in (32, 96, 160):
        [point] = ladder_points(c, [(w, 2)], [10**5])
        assert counts.head_dim(point_config(c, point).model) == 32


def test_print_commands_are_train_commands_of_each_point(tmp_path, capsys):
    args = ["scale", "--workdir", str(tmp_path / "W"), "--widths", "32,64", "--tokens", "100K,0.2M", "--print-commands"]
    assert main([*args, "--config.optim.lr=1e-3", "--config.optim.decay_steps=600"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    names = [f"w{w}-l2-{t}" for w in (32, 64) for t in ("100K", "200K")]
    for line, name in zip(lines, names):
        argv = shlex.split(line)
        assert argv[:4] == ["lm", "train", "--config", TINY]
        assert argv[argv.index("--workdir") + 1] == str(tmp_path / "W" / "points" / name)
        _, overrides = _split_overrides(argv[2:])
        c = load_config(TINY, overrides)
        assert c.optim.lr == 1e-3 and c.optim.decay_steps == 0  # the schedule ends with the point
        assert c.model.d_model == int(name[1:3]) and c.model.n_layers == 2
        assert c.train.steps == round(int(name.split("-")[-1][:-1]) * 1000 / 4096)
    assert not (tmp_path / "W").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--widths", "48"], "width 48 (--widths, --shapes): expected a multiple of the config's head_dim 32"),
        (["--widths", "64,x"], "--widths '64,x': expected positive integers"),
        (["--tokens", "1x"], "--tokens '1x': expected a positive count"),
        (["--tokens", "0"], "--tokens '0': expected a positive count"),
        (["--shapes", "64"], "--shapes '64': expected WIDTHxDEPTH"),
        (["--budget", "-3"], "--budget '-3': expected FLOPs as a positive number"),
        (["--bootstrap", "3"], "--bootstrap 3: expected at least 10"),
        (["--widths", "32", "--tokens", "1M,2M"], "2 point(s) (--widths x --depths x --tokens, or --shapes)"),
        (["--tokens", "1000,1001"], "two budgets round to the same number of steps"),
        (["--config.train.init=runs/x"], "a ladder trains every shape from scratch"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, capsys, args, message):
    assert main(["scale", "--workdir", str(tmp_path / "W"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("lm: error: ")
    assert not (tmp_path / "W").exists()


def _finish(workdir: pathlib.Path, config, point, loss: float) -> None:
    """A point's workdir as a finished `lm train` leaves it (the files the ladder reads)."""
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(point_config(config, point).to_json())
    (workdir / "summary.json").write_text(json.dumps({"step": point.steps, "eval_loss": loss}))


def test_finished_points_are_read_back_not_retrained(tmp_path, capsys, monkeypatch):
    import lm.train.pretrain

    def spy(*a, **k):
        raise AssertionError("a finished point was trained again")

    monkeypatch.setattr(lm.train.pretrain, "train", spy)
    config = load_config(TINY)
    law = Law(E=2.0, A=40.0, B=300.0, alpha=0.4, beta=0.45)
    points = ladder_points(config, [(w, 2) for w in (32, 64, 96)], [250_000, 1_000_000])
    work = tmp_path / "W"
    for p in points:
        c = point_config(config, p)
        _finish(work / "points" / p.name, config, p, float(law.loss(counts.param_count(c.model), p.steps * 4096)))
    before = {f: f.stat().st_mtime_ns for f in work.rglob("*") if f.is_file()}
    args = ["scale", "--workdir", str(work), "--widths", "32,64,96", "--tokens", "250K,1M", "--bootstrap", "20"]
    args += ["--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("read back (finished before)") == 6
    assert before == {f: f.stat().st_mtime_ns for f in before}
    rows = [json.loads(line) for line in (work / "ladder.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == [p.name for p in points]
    assert rows[0]["loss"] == pytest.approx(float(law.loss(rows[0]["params"], rows[0]["tokens"])))
    report = json.loads((work / "scaling.json").read_text())
    assert report["law"]["alpha"] == pytest.approx(0.4, abs=0.05)
    assert report["optimum"]["flops"] == pytest.approx(4 * max(r["flops"] for r in rows))
    assert (work / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "compute-optimal for" in out and "tokens per param" in out
    # the plan verb places a config against that fit
    assert main(["plan", "--config", TINY, "--scaling", str(work / "scaling.json")]) == 0
    out = capsys.readouterr().out
    assert "tokens/param" in out and "N / N_opt = " in out


def test_a_point_of_another_config_stops_the_ladder(tmp_path, capsys):
    config = load_config(TINY)
    points = ladder_points(config, [(w, 2) for w in (32, 64, 96)], [250_000, 1_000_000])
    _finish(tmp_path / "W" / "points" / points[0].name, load_config(TINY, ["model.vocab_size=4096"]), points[0], 5.0)
    assert main(["scale", "--workdir", str(tmp_path / "W"), "--widths", "32,64,96", "--tokens", "250K,1M"]) == 2
    assert "holds a finished run of another config" in capsys.readouterr().err


# bytes, no curation, minute shapes: head_dim 16, 256 tokens a step
SMALL = [
    "--config.data.curate=false",
    "--config.data.tokenizer=byte",
    "--config.model.vocab_size=264",
    "--config.model.d_model=32",
    "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1",
    "--config.model.d_ff=64",
    "--config.data.seq_len=32",
    "--config.train.batch_size=8",
    "--config.eval.batches=2",
    "--config.eval.batch_size=8",
    "--config.train.peak_flops=1e11",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_small_ladder_end_to_end_and_resumed(tmp_path, corpus, capsys):
    work = tmp_path / "W"
    args = ["scale", "--workdir", str(work), "--shapes", "16x1,32x1", "--tokens", "1K,2K,3K", "--bootstrap", "10"]
    args += ["--no-progress", f"--config.data.corpus={corpus}", *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (work / "ladder.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(np.isfinite(r["loss"]) for r in rows)
    assert [r["steps"] for r in rows[:3]] == [4, 8, 12]
    assert out.count("trained in") == 6 and "compute-optimal for" in out
    report = json.loads((work / "scaling.json").read_text())
    assert {"law", "intervals", "bootstrap", "points", "optimum"} <= report.keys()
    assert (work / "scaling.png").read_bytes()[:4] == b"\x89PNG"

    # again: nothing is retrained, no point's file changes
    files = {f: f.stat().st_mtime_ns for f in (work / "points").rglob("*") if f.is_file()}
    assert main(args) == 0
    assert capsys.readouterr().out.count("read back (finished before)") == 6
    assert files == {f: f.stat().st_mtime_ns for f in files}

    # a point killed in its end-of-run work (no summary.json) resumes from its checkpoint, alone
    cut = work / "points" / rows[1]["name"]
    (cut / "summary.json").unlink()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("read back (finished before)") == 5 and "restoring the final checkpoint" in out
    assert json.loads((cut / "summary.json").read_text())["eval_loss"] == pytest.approx(rows[1]["loss"], abs=1e-5)
