"""The evaluation report (JSON), its printed table, and two reports side by side.

Report: {"model": source, "tasks": {NAME: {"kind", "path", "n", "metrics", "per_example",
"example_ids", ...}}}. per_example keeps every example's score so that any subset (the clean
one of a contamination check) or a bootstrap can be recomputed later without the model.

`compare` puts the headline metrics of two reports side by side with B - A and a 95% bootstrap
confidence interval of the difference: paired (the same resampled examples on both sides) when
both scored the same examples, else each side resampled on its own.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from lm.errors import UserError
from lm.eval.sets import lm_metrics

HEADLINE = {"lm": ("bits_per_byte", "loss"), "choice": ("acc", "acc_norm")}
BOOTSTRAP = 1000


def headline(entry: dict) -> tuple[str, ...]:
    """The metrics a task is compared on: bits per byte and loss, accuracies, or its scorer."""
    return HEADLINE.get(entry["kind"]) or tuple(entry["per_example"])


def metric(entry: dict, name: str, keep=None) -> float:
    """A task's metric over the examples `keep` (indices; None = all) from its per-example scores."""
    per = entry["per_example"]
    if entry["kind"] == "lm":
        return lm_metrics(per, keep)[name]
    values = np.asarray(per[name], np.float64)
    return float(values.mean() if keep is None else values[keep].mean())


def table(report: dict) -> str:
    lines = [f"{'task':<20} {'kind':<10} {'n':>6}  metrics   ({report.get('model', '')})"]
    for name, e in report["tasks"].items():
        shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in e["metrics"].items())
        lines.append(f"{name:<20} {e['kind']:<10} {e['n']:>6}  {shown}")
    return "\n".join(lines)


def bootstrap_diff(a: dict, b: dict, name: str, rounds: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95% interval of metric(b) - metric(a) over resampled examples."""
    rng = np.random.default_rng(seed)
    paired = a.get("example_ids") == b.get("example_ids") and a["n"] == b["n"]
    diffs = []
    for _ in range(rounds):
        ka = rng.integers(0, a["n"], a["n"])
        kb = ka if paired else rng.integers(0, b["n"], b["n"])
        diffs.append(metric(b, name, kb) - metric(a, name, ka))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return float(lo), float(hi)


def compare(a: dict, b: dict, rounds: int = BOOTSTRAP) -> dict:
    """{task: {metric: {'a', 'b', 'diff', 'ci95', 'paired'}}} over the tasks both reports hold."""
    out = {}
    for name in a["tasks"]:
        if name not in b["tasks"]:
            continue
        ea, eb = a["tasks"][name], b["tasks"][name]
        out[name] = {}
        for m in headline(ea):
            va, vb = metric(ea, m), metric(eb, m)
            out[name][m] = {
                "a": va,
                "b": vb,
                "diff": vb - va,
                "ci95": bootstrap_diff(ea, eb, m, rounds),
                "paired": ea.get("example_ids") == eb.get("example_ids"),
            }
    return out


def compare_table(a: dict, b: dict, result: dict) -> str:
    lines = [
        f"A: {a.get('model', '?')}",
        f"B: {b.get('model', '?')}",
        f"{'task':<20} {'metric':<14} {'A':>9} {'B':>9} {'B - A':>9}  95% CI (bootstrap)",
    ]
    for task, metrics in result.items():
        for m, r in metrics.items():
            lo, hi = r["ci95"]
            lines.append(
                f"{task:<20} {m:<14} {r['a']:>9.4f} {r['b']:>9.4f} {r['diff']:>+9.4f}  [{lo:+.4f}, {hi:+.4f}]"
                + ("" if r["paired"] else "  unpaired")
            )
    missing = sorted(set(a["tasks"]) ^ set(b["tasks"]))
    if missing:
        lines.append(f"(in one report only: {', '.join(missing)})")
    return "\n".join(lines)


def read_report(path: str, flag: str) -> dict:
    """An `lm eval --out` report, or a one-line error naming the command-line `flag` it came from."""
    try:
        report = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{flag}: '{path}' does not exist (an `lm eval --out` report)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{flag}: '{path}' is not JSON ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("tasks"), dict):
        raise UserError(f"{flag}: '{path}' is not an `lm eval` report (no 'tasks')")
    return report
