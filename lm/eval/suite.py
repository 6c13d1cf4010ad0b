"""One evaluation of several trained models on the same tasks, and its table: the end of `lm demo`.

Every model is scored with `lm eval`'s tasks: bits per byte on the pretraining run's held-out
split, and a generation task (exact match, greedy, chat template) on the task's held-out
conversations. The held-out conversations are checked for 13-gram overlap against everything
the models trained on (lm.eval.contamination). Reports go to OUT/<model>.json, so
`lm eval --compare OUT/a.json OUT/b.json` works on them afterwards.
"""

from __future__ import annotations

import json
import pathlib

from lm.data.cache import data_cache_dir
from lm.data.prepare import prepare_pretrain_data
from lm.eval.cli import evaluate
from lm.eval.report import compare
from lm.store.load import load_trained
from lm.store.meta import init_config

HELDOUT_TOKENS = 1 << 17  # of the pretraining held-out split: enough for 3 decimals of bits per byte


def pretraining_shards(run_dir) -> tuple[list[str], list[str]]:
    """The token shard sets (train, held-out) a pretraining run read, from its data cache."""

    config = init_config(str(run_dir))
    data = prepare_pretrain_data(
        config.data,
        data_cache_dir(config.data),
        vocab_size=config.model.vocab_size,
        progress=False,
        curate_cfg=config.curate,
    )
    return [str(s.shards.path) for s in data.train], [str(s.shards.path) for s in data.heldout]


def evaluate_models(models: dict, specs: list[str], out_dir, progress: bool = False) -> dict:
    """{model name: report} for models {name: workdir}; each report written to OUT/<name>.json."""

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = {}
    for name, workdir in models.items():
        reports[name] = evaluate(load_trained(workdir=str(workdir)), specs, progress=progress)
        (out_dir / f"{name}.json").write_text(json.dumps(reports[name], indent=1))
        print(
            f"evaluated {name}: " + ", ".join(f"{t} {_headline(e)}" for t, e in reports[name]["tasks"].items()),
            flush=True,
        )
    return reports


def _headline(e: dict) -> str:
    m = e["metrics"]
    return (
        f"{m['bits_per_byte']:.4f} bits/byte" if e["kind"] == "lm" else ", ".join(f"{k} {v:.1%}" for k, v in m.items())
    )


def summary(reports: dict, lm_task: str, gen_task: str, baseline: str, contamination: dict | None) -> dict:
    """The figures the table shows: per model bits per byte and exact match, the difference of each
    model's exact match to `baseline` with its bootstrap interval, and the contamination counts."""
    rows = {}
    for name, r in reports.items():
        t = r["tasks"]
        diff = compare(reports[baseline], r)[gen_task] if name != baseline else {}
        rows[name] = {
            "bits_per_byte": t[lm_task]["metrics"]["bits_per_byte"],
            "exact_match": t[gen_task]["metrics"]["exact"],
            "n": t[gen_task]["n"],
            "vs_baseline": diff.get("exact"),
        }
    return {"models": rows, "baseline": baseline, "contamination": contamination}


def table(s: dict) -> str:
    lines = [
        "evaluation (lm eval; reports in eval/<model>.json):",
        f"  {'model':<10} {'held-out bits/byte':>18} {'exact match':>12}   vs {s['baseline']} (95% bootstrap CI)",
    ]
    for name, r in s["models"].items():
        d = r["vs_baseline"]
        vs = f"{100 * d['diff']:+.1f} pts [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]" if d else "-"
        lines.append(f"  {name:<10} {r['bits_per_byte']:>18.4f} {r['exact_match']:>12.1%}   {vs}")
    c = s["contamination"]
    if c:
        lines.append(
            f"contamination: {c['contaminated']} of {c['examples']} held-out conversations share a "
            f"{c['n']}-gram (shorter ones: their whole text) with the training data ({c['train_mb']:.1f} MB "
            f"of pretraining shards and task conversations at {c['mb_per_s']:.0f} MB/s; "
            f"{c['too_short']} too short to check); with the held-out file added to the training data "
            f"it flags {c['found_when_planted']} of {c['examples']}"
        )
    return "\n".join(lines)
