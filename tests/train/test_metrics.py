"""Metrics files: JSONL rows, non-finite values kept visible, truncation on resume, the plots; and what
the loop logs: progress in a log, flushes at checkpoints, MFU against a measured peak."""

import dataclasses
import itertools
import json
import math
from types import SimpleNamespace

from lm.train import loop, pairs
from lm.train.loop import LoopSpec, run_loop
from lm.train.metrics import (
    MetricsWriter,
    curves_figure,
    metrics_problem,
    moe_routing,
    plot_curves,
    plot_rl,
    plot_runs,
    read_metrics,
    rl_figure,
    runs_figure,
    truncate_after,
)


def test_rows_carry_a_running_digest_that_finds_edits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        writer.write(step, {"loss": 1.0 / step})
    anchor = writer.digest
    writer.write(4, {"loss": 0.25})
    writer.close()
    text = path.read_text()
    assert metrics_problem(path, 3, anchor) is None and metrics_problem(path, 4, writer.digest) is None
    # A reopened writer continues the chain from the last row.
    again = MetricsWriter(tmp_path)
    again.write(5, {"loss": 0.2})
    again.close()
    assert metrics_problem(path, 5, again.digest) is None
    lines = text.splitlines(keepends=True)
    edited = json.loads(lines[1]) | {"loss": 0.75}
    path.write_text(lines[0] + json.dumps(edited) + "\n" + "".join(lines[2:]))
    assert metrics_problem(path, 3, anchor).startswith(f"{path}:2: the row of step 2 is not the one the run wrote")
    swapped = [lines[0], lines[2], lines[1], lines[3]]  # rows moved: their digests no longer chain
    path.write_text("".join(swapped))
    assert metrics_problem(path, 4, writer.digest).startswith(f"{path}:2:")
    path.write_text("".join(lines[:1] + lines[2:]))  # a row removed
    assert metrics_problem(path, 3, anchor).startswith(f"{path}:2:")
    path.write_text(lines[0])  # rows cut: the checkpoint's anchor is gone
    assert "missing or replaced" in metrics_problem(path, 3, anchor)
    old = [{k: v for k, v in json.loads(line).items() if k != "digest"} for line in lines]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))  # rows of a run from before digests
    assert metrics_problem(path, 4, None) is None


def test_rows_truncation_and_plot(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in (10, 20, 30):
        writer.write(step, {"loss": 3.0 / step, "lr": 0.1})
    writer.write(20, {"eval_loss": 0.2})
    writer.write(40, {"loss": math.nan, "grad_norm": math.inf})
    writer.close()
    rows = [{k: v for k, v in r.items() if k != "digest"} for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert rows[0] == {"step": 10, "loss": 0.3, "lr": 0.1}
    assert rows[-1] == {"step": 40, "loss": "nan", "grad_norm": "inf"}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "loss.png", baseline=1.0)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    truncate_after(tmp_path / "metrics.jsonl", 20)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20, 20]


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not list(tmp_path.iterdir())


def test_plot_labels_say_what_each_axis_holds(tmp_path, monkeypatch):
    rows = [
        {
            "step": s,
            "loss": 1.0 / s,
            "eval_loss": 1.2 / s,
            "lr": 0.1,
            "reward": 0.1 * s,
            "eval_reward": 0.2,
            "kl": 0.01 * s,
            "response_length": 12.0,
        }
        for s in (1, 2, 3)
    ]
    assert [ax.get_ylabel() for ax in curves_figure(rows).axes] == ["loss (nats/token)", "learning rate"]
    assert curves_figure(rows, loss_label="loss (mean per pair)").axes[0].get_ylabel() == "loss (mean per pair)"
    labels = [ax.get_ylabel() for ax in rl_figure(rows).axes]
    assert labels == ["reward per response", "KL to the reference (nats/token)", "response length (tokens)"]
    # DPO and the reward model (pair stages) plot a per-pair loss
    calls = []
    monkeypatch.setattr(pairs, "plot_curves", lambda *a, **k: calls.append(k))
    pairs.PairStage().plot(SimpleNamespace(workdir=tmp_path))
    assert calls == [{"loss_label": "loss (mean per pair)"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_rl(tmp_path / "metrics.jsonl", tmp_path / "rl.png")
    assert (tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_plot_and_moe_routing(tmp_path):
    dense = [{"step": s, "loss": 2.0 / s, "eval_loss": 2.2 / s} for s in (1, 2, 3)]
    moe = [
        {
            "step": s,
            "loss": 1.9 / s,
            "eval_loss": 2.1 / s,
            "moe_balance": 1.0 + 0.1 / s,
            "moe_router_z": 3.0,
            "moe_dropped": 0.0,
            "moe_load_min_l0": 0.5,
            "moe_load_max_l0": 1.5,
            "moe_load_entropy_l0": 0.9,
            "moe_load_min_l1": 0.25,
            "moe_load_max_l1": 2.0,
            "moe_load_entropy_l1": 0.8,
        }
        for s in (1, 2, 3)
    ]
    fig = runs_figure({"dense": dense, "moe": moe}, baseline=1.0)
    gap = fig.axes[1].lines[0]  # the second run's held-out loss minus the first's, at the steps both evaluated
    assert list(gap.get_xdata()) == [1, 2, 3]
    assert [round(y, 6) for y in gap.get_ydata()] == [round(-0.1 / s, 6) for s in (1, 2, 3)]
    for name, rows in (("dense", dense), ("moe", moe)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_runs(
        {"dense": tmp_path / "dense" / "metrics.jsonl", "moe": tmp_path / "moe" / "metrics.jsonl"},
        tmp_path / "runs.png",
        until=2,
    )
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
    g = moe_routing(moe)
    assert (g["step"], g["load_min"], g["load_max"], g["dropped"]) == (3, 0.25, 2.0, 0.0)
    assert g["per_layer"][1] == {"min": 0.25, "max": 2.0, "entropy": 0.8}
    assert moe_routing(dense) == {}


@dataclasses.dataclass
class FakeState:
    step: int


class Calls:
    """A checkpointer and a writer that record what the loop asks of them, in order."""

    def __init__(self):
        self.calls, self.rows = [], []

    def due(self, step):
        return step % 4 == 0

    def time_due(self):
        return False

    def local_due(self, step):
        return False

    def save(self, step, state, data_iter, health=None, local_only=False):
        self.calls.append(("save", step))

    def write(self, step, row):
        self.rows.append({"step": step} | row)
        self.calls.append(("write", step))

    def flush(self):
        self.calls.append(("flush",))


def fake_loop(total=8, peak=1e30, measure=None, show=False):
    spec = LoopSpec(total, 2, 0, tokens_per_step=1000, flops_per_token=1e6, peak_flops=peak, measure_peak=measure)
    calls = Calls()
    step_fn = lambda state, batch: (FakeState(state.step + 1), {"loss": 2.0})  # noqa: E731
    state, last = run_loop(
        spec,
        FakeState(0),
        step_fn,
        itertools.count(),
        lambda b: b,
        writer=calls,
        checkpointer=calls,
        show_progress=show,
    )
    return calls, last


def test_writer_is_flushed_right_after_each_checkpoint():
    calls, _ = fake_loop()
    saves = [i for i, c in enumerate(calls.calls) if c[0] == "save"]
    assert [calls.calls[i][1] for i in saves] == [4, 8]
    assert all(calls.calls[i + 1] == ("flush",) for i in saves)


def test_progress_in_a_log_is_plain_lines_without_carriage_returns(capfd):
    fake_loop(show=True)  # captured output is not a terminal
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "\x1b[" not in out + err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/8", "step 4/8", "step 6/8", "step 8/8"]
    assert "loss 2.000" in lines[0] and "mfu" in lines[1]


def test_progress_on_a_terminal_is_a_bar(monkeypatch, capfd):
    monkeypatch.setattr(loop, "bars", lambda show: show)
    fake_loop(show=True)
    out, err = capfd.readouterr()
    assert "\r" in err and not [line for line in out.splitlines() if line.startswith("step ")]


def test_mfu_never_exceeds_one_against_a_measured_peak():
    measured = []
    # the start-up peak (1 FLOP/s) was measured under load: measured again, the larger figure kept
    calls, last = fake_loop(peak=1.0, measure=lambda: measured.append(1) or 1e30)
    mfus = [r["mfu"] for r in calls.rows if "mfu" in r]
    assert measured == [1] and mfus and all(0 < m < 1e-6 for m in mfus)
    assert last["peak_flops"] == 1e30 and "re-measured at step 2" in last["peak_flops_revised"]
    assert [r["peak_flops"] for r in calls.rows if "peak_flops" in r] == [1e30]
    # measured again and still beaten (the run outpaces the matmul): the achieved rate is the peak
    calls, last = fake_loop(peak=1.0, measure=lambda: measured.append(2) or 2.0)
    mfus = [r["mfu"] for r in calls.rows if "mfu" in r]
    assert measured == [1, 2] and all(0 < m <= 1.0 for m in mfus) and mfus[0] == 1.0
    assert 0 < last["run_mfu"] <= 1.0 and last["peak_flops"] > 2.0
    assert "raised to the achieved" in last["peak_flops_revised"]
    # a given peak (train.peak_flops) is the user's figure: not revised
    calls, last = fake_loop(peak=1.0)
    assert all(r["mfu"] > 1 for r in calls.rows if "mfu" in r) and "peak_flops_revised" not in last
