"""`lm distill` end to end: a student learns from a frozen teacher of another width and depth
(never in the student's checkpoints), the held-out divergence falls, resume is exact, and a
teacher that does not share the vocabulary is one clear line."""

import json

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_task
from tests.e2e.test_cli_sft import SFT
from tests.e2e.test_cli_train import SMALL, final_params


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_base, corpus):
    """(student init: the small base, d_model 32 x 2 layers; teacher: d_model 64 x 3 layers; the task)."""
    root = tmp_path_factory.mktemp("distill")
    teacher = root / "teacher"
    assert (
        main(
            [
                "train",
                "--workdir",
                str(teacher),
                f"--config.data.corpus={corpus}",
                "--config.train.steps=10",
                "--config.eval.every_steps=10",
                *SMALL,
                "--config.data.seq_len=64",
                "--config.model.d_model=64",
                "--config.model.n_layers=3",
                "--config.model.d_ff=128",
            ]
        )
        == 0
    )
    return small_base, teacher, write_sort_task(root / "task", n_train=200, n_heldout=8)


def distill(runs, workdir, steps, *extra, teacher=None):
    student, default_teacher, task = runs
    return main(
        [
            "distill",
            "--teacher",
            str(teacher or default_teacher),
            "--init",
            str(student),
            "--data",
            str(task["train"]),
            "--eval-data",
            str(task["heldout"]),
            "--workdir",
            str(workdir),
            f"--config.train.steps={steps}",
            *SFT,
            *extra,
        ]
    )


@pytest.mark.slow
def test_distill_lowers_the_divergence_and_resumes_exactly(runs, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert distill(runs, straight, 10, "--config.distill.divergence=jsd", "--config.distill.temperature=2.0") == 0
    summary = json.loads((straight / "summary.json").read_text())
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == 0)
    assert summary["eval_loss"] < first["eval_loss"]  # the held-out divergence to the teacher
    assert {"eval_nll", "eval_top1_agreement", "top1_agreement", "nll"} <= summary.keys()
    assert 0 <= summary["eval_top1_agreement"] <= 1 and summary["divergence"] == "jsd"
    params = final_params(straight, 10)
    assert params["embedding"].shape[1] == 32  # the student's width: the teacher (64) is not in the checkpoint
    assert distill(runs, split, 5, "--config.distill.divergence=jsd", "--config.distill.temperature=2.0") == 0
    assert (
        distill(runs, split, 10, "--config.distill.divergence=jsd", "--config.distill.temperature=2.0", "--resume") == 0
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final_params(split, 10))):
        np.testing.assert_array_equal(a, b)


def test_a_teacher_of_another_vocabulary_or_none_is_one_line(runs, tmp_path, capsys, corpus):
    other = tmp_path / "other"
    assert (
        main(
            [
                "train",
                "--workdir",
                str(other),
                f"--config.data.corpus={corpus}",
                "--config.train.steps=2",
                "--config.eval.every_steps=2",
                *SMALL,
                "--config.model.vocab_size=300",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert distill(runs, tmp_path / "a", 2, teacher=other) == 2
    assert "model.vocab_size=300" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # refused before anything is written
    student, _, task = runs
    assert (
        main(
            [
                "distill",
                "--init",
                str(student),
                "--data",
                str(task["train"]),
                "--workdir",
                str(tmp_path / "b"),
                "--teacher",
                "",
            ]
        )
        == 2
    )
    assert "distill.teacher is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_on_policy_steps_sample_the_student_and_resume_exactly(runs, tmp_path):
    """GKD's mix: about half the steps train on the student's own responses; which ones, and the
    samples, are drawn from the seed and the step, so a split run equals a straight one."""
    mix = [
        "--config.distill.on_policy_fraction=0.5",
        "--config.distill.max_new_tokens=8",
        "--config.distill.divergence=reverse_kl",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert distill(runs, straight, 8, *mix, "--config.train.log_every=1") == 0
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "on_policy" in r]
    assert {r["on_policy"] for r in logged} == {0.0, 1.0}
    assert all(0 < r["response_length"] <= 8 for r in logged if r["on_policy"] == 1.0)
    assert distill(runs, split, 4, *mix, "--config.train.log_every=1") == 0
    assert distill(runs, split, 8, *mix, "--config.train.log_every=1", "--resume") == 0
    for a, b in zip(jax.tree.leaves(final_params(straight, 8)), jax.tree.leaves(final_params(split, 8))):
        np.testing.assert_array_equal(a, b)
