"""Run metrics: one JSON object per line, TensorBoard event files, and PNG curves.

`metrics.jsonl` is the record of a run: each row is appended (and the file closed) as it
comes, and on resume the file is cut back to the restored step, atomically. Each row carries a
running digest (`digest`: a sha256 of the previous row's digest and this row), and every
checkpoint records the digest of the rows written before it: a resume finds an edited, removed
or inserted row (`metrics_problem`) instead of carrying it on. The TensorBoard
event file is a view of it, rebuilt from metrics.jsonl whenever a writer opens: after a kill
and a resume, a reader sees each step once with exactly the values of metrics.jsonl (events
still buffered at the kill are written again, events past the restored step are gone).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import sys
import time
import uuid

import numpy as np

from lm.data.jsonl import iter_jsonl
from lm.outputs import atomic_open

EXPECTED = "one JSON object of metrics per line"
FLUSH_SECONDS = 10.0  # a row written this long after the last flush flushes the events (checkpoints do too)


class MetricsWriter:
    """Appends rows to `metrics.jsonl` and scalars to TensorBoard under the run directory."""

    def __init__(self, workdir: pathlib.Path, enabled: bool = True):
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.events_dir = pathlib.Path(workdir) / "tensorboard"
        self.enabled = enabled
        self._tb, self._flushed = None, time.monotonic()
        self.digest = ""  # of the last row written: what a checkpoint records
        if enabled:
            rows = read_metrics(self.path) if self.path.exists() else []
            self.digest = rows[-1].get("digest", "") if rows else ""
            self._tb = _fresh_event_file(self.events_dir, rows)

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)} | {k: _plain(v) for k, v in values.items()}
        row["digest"] = self.digest = row_digest(self.digest, row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        _add_row(self._tb, row)
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Puts the buffered TensorBoard events on disk (metrics.jsonl rows are there already)."""
        if self._tb is not None:
            self._tb.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def row_digest(previous: str, row: dict) -> str:
    """The running digest of a metrics row: the previous row's digest and this row's values."""
    body = json.dumps({k: v for k, v in row.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{previous}\n{body}".encode()).hexdigest()[:16]


def metrics_problem(path: pathlib.Path, step: int, anchor: str | None) -> str | None:
    """What shows the rows of metrics.jsonl up to `step` are not those the run wrote (a row whose
    digest does not match, or the checkpoint's `anchor` digest missing), or None. Rows without a
    digest (written before digests existed) restart the chain, as the writer does."""
    path = pathlib.Path(path)
    if not path.is_file():
        return None  # gone: the resumed run starts a new record
    rows, _ = _read_rows(path)
    previous, seen = "", {""}
    for line, row in enumerate(rows, 1):
        if row["step"] > step:
            break
        if "digest" not in row:
            previous = ""
            continue
        if row["digest"] != row_digest(previous, row):
            return (
                f"{path}:{line}: the row of step {row['step']} is not the one the run wrote "
                "(edited after it was logged: its digest does not match)"
            )
        previous = row["digest"]
        seen.add(previous)
    if anchor and anchor not in seen:
        return (
            f"{path}: the rows logged before the checkpoint of step {step} are missing or replaced "
            "(the digest the checkpoint recorded is not in the file)"
        )
    return None


def _fresh_event_file(directory: pathlib.Path, rows: list[dict]):
    """A new event file holding `rows`; the older event files in `directory` are then removed."""
    from tensorboardX.event_file_writer import EventsWriter  # lazily: heavy, and only process 0 writes
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    directory.mkdir(parents=True, exist_ok=True)
    old = list(directory.glob("events.out.tfevents.*"))
    # Synchronous (no queue): a flush means every event written so far is on disk. The suffix keeps
    # the name apart from an old file of the same second, which is deleted below.
    tb = EventsWriter(str(directory / "events"), f".{os.getpid()}.{uuid.uuid4().hex[:8]}")
    # A restart at step 0: a TensorBoard already showing the old files drops what they held.
    tb.write_event(Event(wall_time=time.time(), step=0, session_log=SessionLog(status=SessionLog.START)))
    for row in rows:
        _add_row(tb, row)
    tb.flush()
    for path in old:
        path.unlink(missing_ok=True)
    return tb


def _add_row(tb, row: dict) -> None:
    """The numbers of a row as one event at its step (text, e.g. 'nan', stays in metrics.jsonl only)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    values = [
        Summary.Value(tag=k, simple_value=float(v))
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float))
    ]
    if values:
        tb.write_event(Event(wall_time=time.time(), step=row["step"], summary=Summary(value=values)))


def _plain(v):
    v = np.asarray(v).item() if hasattr(v, "shape") else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


def json_default(x):
    """json.dumps(default=...) for a summary: finite numpy floats as floats, anything else as text."""
    return float(x) if isinstance(x, (np.floating, float)) and math.isfinite(float(x)) else str(x)


def _metrics_row(value):
    if not isinstance(value, dict) or isinstance(value.get("step"), bool) or not isinstance(value.get("step"), int):
        raise ValueError(f"expected a JSON object with an integer 'step', got {json.dumps(value)[:80]}")
    return value


def _read_rows(path: pathlib.Path) -> tuple[list[dict], str | None]:
    """The rows of a metrics file, and a note when its last line was cut short.

    A last line without its newline that does not parse is a row whose writer was killed
    mid-write: it is dropped. Any other bad line is an error naming FILE:LINE.
    """
    path = pathlib.Path(path)
    data = path.read_bytes() if path.is_file() else b""
    cut_line = data.count(b"\n") + 1 if data and not data.endswith(b"\n") else None
    cut = []

    def on_error(bad):
        if bad.line != cut_line or not isinstance(bad.cause, (json.JSONDecodeError, UnicodeDecodeError)):
            raise bad
        cut.append(bad)

    rows = [row for _, row in iter_jsonl(path, _metrics_row, expected=EXPECTED, on_error=on_error)]
    note = (
        (f"{cut[0].where}: dropped a partial last line (its writer was killed mid-write): {cut[0].problem}")
        if cut
        else None
    )
    return rows, note


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The rows of a metrics file; a partial last line (a writer killed, or still writing) is left out."""
    return _read_rows(path)[0]


def truncate_after(path: pathlib.Path, step: int) -> None:
    """On resume, drop rows logged after the restored step so the file reads as one run.

    The kept rows go to a temporary file that then replaces the old one: a kill at any moment
    leaves either file whole.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return
    rows, note = _read_rows(path)
    if note:
        print(f"lm: note: {note}", file=sys.stderr)
    with atomic_open(path) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))


def plot_curves(
    metrics_path: pathlib.Path,
    out_path: pathlib.Path,
    baseline: float | None = None,
    loss_label: str = "loss (nats/token)",
) -> None:
    """Train and eval loss against step (and the learning rate) as a PNG; `loss_label` names the
    loss's unit (a pair stage's loss is per pair, not per token)."""
    _save(curves_figure(read_metrics(metrics_path), baseline, loss_label), out_path)


def curves_figure(rows: list[dict], baseline: float | None = None, loss_label: str = "loss (nats/token)"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
    evals = [(r["step"], r["eval_loss"]) for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    lrs = [(r["step"], r["lr"]) for r in rows if isinstance(r.get("lr"), (int, float))]
    sets = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/bits_per_byte")})
    heights = [3, 2, 1] if sets else [3, 1]
    fig, axes = plt.subplots(len(heights), 1, figsize=(8, 2 * len(heights) + 2), height_ratios=heights, sharex=True)
    ax, ax_lr = axes[0], axes[-1]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss", lw=1.5)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set_ylabel(loss_label)
    ax.legend()
    ax.grid(alpha=0.3)
    if sets:  # eval.sets: bits per byte of each named set (lm.eval.during)
        for key in sets:
            axes[1].plot(*zip(*[(r["step"], r[key]) for r in rows if key in r]), "o-", label=key.split("/")[1], lw=1)
        axes[1].set_ylabel("bits per byte")
        axes[1].legend()
        axes[1].grid(alpha=0.3)
    if lrs:
        ax_lr.plot(*zip(*lrs), color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    fig.tight_layout()
    return fig


def moe_routing(rows: list[dict]) -> dict:
    """A mixture-of-experts run's routing at its last logged train step (lm.model.moe's metrics):
    balance loss (1 = even), router z-loss, share of assignments dropped, and each layer's expert
    load (min and max as multiples of an even share, entropy over log(n_experts)); {} for a dense run."""
    logged = [r for r in rows if isinstance(r.get("moe_balance"), (int, float))]
    if not logged:
        return {}
    last = logged[-1]
    layers = sorted(int(k.rsplit("_l", 1)[1]) for k in last if k.startswith("moe_load_min_l"))
    per_layer = {i: {name: last[f"moe_load_{name}_l{i}"] for name in ("min", "max", "entropy")} for i in layers}
    return {
        "step": last["step"],
        "balance": last["moe_balance"],
        "router_z": last["moe_router_z"],
        "dropped": last["moe_dropped"],
        "load_min": min(v["min"] for v in per_layer.values()),
        "load_max": max(v["max"] for v in per_layer.values()),
        "per_layer": per_layer,
    }


def plot_runs(
    runs: dict,
    out_path: pathlib.Path,
    baseline: float | None = None,
    until: int | None = None,
    title: str | None = None,
) -> None:
    """The train and held-out loss of several runs ({label: metrics.jsonl path}) in one PNG, one
    colour per run; `until`: only the steps up to it (a longer run beside a shorter one)."""
    rows = {
        label: [r for r in read_metrics(path) if until is None or r["step"] <= until] for label, path in runs.items()
    }
    _save(runs_figure(rows, baseline, title), out_path)


def runs_figure(runs: dict, baseline: float | None = None, title: str | None = None):
    """Top: each run's train and held-out loss. Below, with two runs or more: each run's held-out
    loss minus the first run's at the steps both evaluated (the gap the top panel's scale hides)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = lambda rows, key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    heights = [3, 1] if len(runs) > 1 else [1]
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(8, 2 * len(heights) + 3), height_ratios=heights, sharex=True, squeeze=False
    )
    ax = axes[0][0]
    for i, (label, rows) in enumerate(runs.items()):
        for key, style, width, alpha, name in (
            ("loss", "-", 0.8, 0.45, "train"),
            ("eval_loss", "o-", 1.6, 1.0, "held-out"),
        ):
            points = series(rows, key)
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", lw=width, alpha=alpha, ms=4, label=f"{label}: {name}")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set_ylabel("loss (nats/token)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        (first, first_rows), *others = runs.items()
        reference, gap = dict(series(first_rows, "eval_loss")), axes[1][0]
        for i, (label, rows) in enumerate(others, 1):
            points = [(step, v - reference[step]) for step, v in series(rows, "eval_loss") if step in reference]
            if points:
                gap.plot(
                    *zip(*points), "o-", color=f"C{i}", lw=1.4, ms=4, label=f"{label}: held-out loss minus {first}'s"
                )
        gap.axhline(0.0, color="C0", lw=1)
        gap.set_ylabel("gap (nats/token)", fontsize=9)
        gap.legend(fontsize=9)
        gap.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.subplots_adjust(left=max(fig.subplotpars.left, 0.11))  # room for the gap panel's wider tick labels
    return fig


RL_PANELS = (  # (y label, ((metrics key, legend), ...)) per panel
    ("reward per response", (("reward", "sampled responses (mean)"), ("eval_reward", "held-out greedy responses"))),
    ("KL to the reference (nats/token)", (("kl", "policy vs reference, per response token"),)),
    (
        "response length (tokens)",
        (("response_length", "mean sampled response"), ("eval_response_length", "held-out greedy response")),
    ),
)


def plot_rl(metrics_path: pathlib.Path, out_path: pathlib.Path) -> None:
    """RL curves against step as a PNG: train and held-out reward, KL to the reference, response length."""
    _save(rl_figure(read_metrics(metrics_path)), out_path)


def rl_figure(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = lambda key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    fig, axes = plt.subplots(len(RL_PANELS), 1, figsize=(8, 8), sharex=True)
    for ax, (ylabel, lines) in zip(axes, RL_PANELS):
        for key, label in lines:
            points = series(key)
            if points:
                ax.plot(*zip(*points), "o-" if key.startswith("eval_") else "-", label=label, lw=1.2)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


def _save(fig, out_path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(out_path, dpi=100)
    plt.close(fig)
