"""Rejection-sampling fine-tuning: the report's figures by hand, and `lm rft` end to end: each
prompt's best sample kept when above the threshold (and only then), the report agreeing with the
samples file, the kept conversations fine-tuned on, and a resume reusing the kept set."""

import json

import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_task
from lm.train.rft import distribution, summarize

REWARD = "def distinct(prompts, completions, **columns):\n    return [float(len(set(c))) for c in completions]\n"


def test_the_report_counts_prompts_above_the_threshold_and_the_reward_distribution():
    totals = np.array([[0.0, 1.0], [2.0, np.nan], [np.nan, np.nan]])
    best = np.array([1.0, 2.0, np.nan])
    report = summarize(totals, best, threshold=1.0)
    assert (report["prompts"], report["samples"], report["kept"], report["failed_rewards"]) == (3, 6, 1, 3)
    assert report["kept_share"] == pytest.approx(1 / 3)
    assert report["reward"]["n"] == 3 and report["reward"]["mean"] == pytest.approx(1.0)
    assert report["best"]["quantiles"]["max"] == 2.0 and report["best"]["quantiles"]["p50"] == pytest.approx(1.5)
    assert sum(distribution(np.arange(10.0))["histogram"]["counts"]) == 10
    assert distribution(np.array([np.nan])) == {"n": 0}


def rft(base, task, workdir, steps, *extra):
    return main(
        [
            "rft",
            "--init",
            str(base),
            "--data",
            str(task["train"]),
            "--eval-data",
            str(task["heldout"]),
            "--rewards",
            f"{task['rewards']}:distinct",
            "--workdir",
            str(workdir),
            "--config.rft.samples=4",
            "--config.rft.max_new_tokens=8",
            "--config.rft.threshold=6",
            "--config.rft.batch_prompts=8",
            "--config.finetune.epochs=0",
            f"--config.train.steps={steps}",
            "--config.train.batch_size=8",
            "--config.eval.every_steps=2",
            "--config.eval.batch_size=8",
            "--config.checkpoint.every_steps=2",
            "--config.finetune.eval_examples=4",
            "--config.finetune.eval_max_new_tokens=4",
            "--config.train.peak_flops=1e11",
            "--no-progress",
            *extra,
        ]
    )


@pytest.mark.slow
def test_lm_rft_keeps_each_prompts_best_above_the_threshold_reports_it_and_fine_tunes(small_base, tmp_path, capsys):
    task = write_sort_task(tmp_path, 16, 4) | {"rewards": tmp_path / "rewards.py"}
    task["rewards"].write_text(REWARD)
    w = tmp_path / "rft"
    assert rft(small_base, task, w, 2) == 0
    samples = [json.loads(line) for line in (w / "rft_samples.jsonl").read_text().splitlines()]
    kept = [json.loads(line) for line in (w / "rft_kept.jsonl").read_text().splitlines()]
    report = json.loads((w / "rft_report.json").read_text())
    assert len(samples) == 16 * 4 and all(s["reward"] == len(set(s["response"])) for s in samples)
    winners = []
    for p in range(16):
        mine = [s for s in samples if s["prompt"] == p]
        best = max(mine, key=lambda s: s["reward"])  # the first of equal rewards, as argmax
        if best["reward"] > 6:
            winners.append(best["response"])
    assert [k["messages"][-1]["content"] for k in kept] == winners and 0 < len(winners) < 16
    assert (report["prompts"], report["samples"], report["kept"]) == (16, 64, len(winners))
    assert report["best"]["quantiles"]["max"] == max(s["reward"] for s in samples)
    summary = json.loads((w / "summary.json").read_text())
    assert summary["rft"]["kept"] == len(winners) and summary["data"]["examples_read"] == len(winners)
    assert np.isfinite(summary["loss"]) and "exact_match" in summary
    capsys.readouterr()
    assert rft(small_base, task, w, 4, "--resume") == 0
    assert "rft: reusing the kept samples" in capsys.readouterr().out
    assert [json.loads(line) for line in (w / "rft_kept.jsonl").read_text().splitlines()] == kept
