"""Run metrics: one JSON object per line, TensorBoard event files, and PNG curves."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from lm.data.jsonl import iter_jsonl


class MetricsWriter:
    """Appends rows to `metrics.jsonl` and scalars to TensorBoard under the run directory."""

    def __init__(self, workdir: pathlib.Path, enabled: bool = True):
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter  # imported lazily: heavy, and only process 0 writes

            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)} | {k: _plain(v) for k, v in values.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    v = np.asarray(v).item() if hasattr(v, "shape") else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


def json_default(x):
    """json.dumps(default=...) for a summary: finite numpy floats as floats, anything else as text."""
    return float(x) if isinstance(x, (np.floating, float)) and math.isfinite(float(x)) else str(x)


def read_metrics(path: pathlib.Path) -> list[dict]:
    return [row for _, row in iter_jsonl(path, expected="one JSON object of metrics per line")]


def truncate_after(path: pathlib.Path, step: int) -> None:
    """On resume, drop rows logged after the restored step so the file reads as one run."""
    path = pathlib.Path(path)
    if path.exists():
        rows = [r for r in read_metrics(path) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot_curves(metrics_path: pathlib.Path, out_path: pathlib.Path, baseline: float | None = None) -> None:
    """Train and eval loss against step (and the learning rate) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
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
    ax.set_ylabel("loss (nats/token)")
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
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def plot_rl(metrics_path: pathlib.Path, out_path: pathlib.Path) -> None:
    """RL curves against step as a PNG: train and held-out reward, KL to the reference, response length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    series = lambda key: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    panels = [(("reward", "rollout reward (mean)"), ("eval_reward", "held-out greedy reward")),
              (("kl", "KL to the reference"),), (("response_length", "response tokens"),)]
    for ax, panel in zip(axes, panels):
        for key, label in panel:
            points = series(key)
            if points:
                ax.plot(*zip(*points), "o-" if key.startswith("eval_") else "-", label=label, lw=1.2)
        ax.legend()
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
