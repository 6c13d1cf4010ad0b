"""`lm dpo` (ORPO too), `lm kto` and `lm reward` end to end from a small pretrained run: TRL-named metrics on train and
held-out pairs, the exact-match report, precomputed reference log-probs, exact resume with a live reference,
reward scoring of pairs and texts, one-line errors naming file and line."""

import json

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_pairs, write_sort_task
from lm.data.unpaired import unpaired_from_pairs
from tests.e2e.test_cli_train import final_params

COMMON = [
    "--config.finetune.epochs=0",
    "--config.train.batch_size=8",
    "--config.eval.every_steps=3",
    "--config.checkpoint.every_steps=3",
    "--config.eval.batch_size=8",
    "--config.pairs.eval_pairs=8",
    "--config.train.peak_flops=1e11",
    "--config.optim.lr=1e-3",
    "--no-progress",
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return write_sort_pairs(root, n_train=64, n_heldout=8) | {"answers": write_sort_task(root, 8, 8)["heldout"]}


def run(verb, base, task, workdir, steps, *extra, held_out=True):
    heldout = ["--eval-data", str(task["heldout"])] if held_out else []
    return main(
        [
            verb,
            "--init",
            str(base),
            "--data",
            str(task["train"]),
            *heldout,
            "--workdir",
            str(workdir),
            f"--config.train.steps={steps}",
            *COMMON,
            *extra,
        ]
    )


def rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_logs_trl_metrics_and_reports_held_out_pairs_and_answers(small_base, task, tmp_path):
    w = tmp_path / "dpo"
    assert (
        run(
            "dpo",
            small_base,
            task,
            w,
            6,
            "--eval-answers",
            str(task["answers"]),
            "--config.dpo.reference=precomputed",
            "--config.finetune.eval_examples=4",
            "--config.finetune.eval_max_new_tokens=6",
        )
        == 0
    )
    logged = [r for r in rows(w) if "loss" in r]
    keys = {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
        "pairs",
    }
    assert logged and all(keys <= r.keys() and r["pairs"] == 8 for r in logged)
    first = [r for r in rows(w) if r["step"] == 0 and "eval_loss" in r][0]
    assert first["eval_loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert first["eval_rewards/margins"] == pytest.approx(0, abs=1e-5)
    summary = json.loads((w / "summary.json").read_text())
    assert summary["reference"] == "precomputed" and summary["eval"]["eval_rewards/margins"] > 0
    assert set(np.load(w / "reference_logps.npz").files) == {"train", "heldout", "record"}
    assert summary["exact_match_n"] == 4 and 0 <= summary["exact_match"] <= 1
    assert (w / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ipo", "orpo"])
def test_live_reference_resumes_exactly(small_base, task, tmp_path, loss):
    pre = [f"--config.dpo.loss={loss}"]  # ipo: the reference is re-supplied from --init on resume; orpo holds none
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run("dpo", small_base, task, straight, 6, *pre, held_out=False) == 0
    assert run("dpo", small_base, task, split, 3, *pre, held_out=False) == 0
    assert run("dpo", small_base, task, split, 6, *pre, "--resume", held_out=False) == 0
    for x, y in zip(jax.tree.leaves(final_params(straight, 6)), jax.tree.leaves(final_params(split, 6))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_reward_model_trains_and_scores_pairs_and_texts(small_base, task, tmp_path, capsys):
    w = tmp_path / "rm"
    # the scalar head starts at 0 and the 10-step base separates the answers little: a rate that
    # moves the head within the few steps a test affords
    assert run("reward", small_base, task, w, 12, "--config.optim.lr=1e-2") == 0
    summary = json.loads((w / "summary.json").read_text())
    assert summary["eval_init"]["eval_loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert summary["eval"]["eval_loss"] < summary["eval_init"]["eval_loss"]
    capsys.readouterr()
    out = tmp_path / "scores.jsonl"
    assert main(["reward", "score", "--workdir", str(w), "--pairs", str(task["heldout"]), "--out", str(out)]) == 0
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert len(scored) == report["pairs"] == 8
    accuracy = np.mean([r["chosen_score"] > r["rejected_score"] for r in scored])
    assert report["accuracy"] == pytest.approx(accuracy)
    texts = tmp_path / "texts.jsonl"
    pair = json.loads(task["heldout"].read_text().splitlines()[0])
    texts.write_text(json.dumps({"prompt": pair["prompt"], "response": pair["chosen"]}) + "\n")
    assert main(["reward", "score", "--workdir", str(w), "--texts", str(texts)]) == 0
    score = json.loads(capsys.readouterr().out.splitlines()[0])["score"]
    assert score == pytest.approx(scored[0]["chosen_score"], rel=1e-5)  # the same text, the same score


def test_bad_pairs_are_one_line_naming_file_and_line(small_base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "sort 21", "chosen": "12", "rejected": "21"}\n{"prompt": "sort 3", "chosen": "3"}\n')
    assert main(["dpo", "--init", str(small_base), "--data", str(bad), "--workdir", str(tmp_path / "w"), *COMMON]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lm: error:")]
    assert len(errors) == 1 and f"{bad}:2" in errors[0] and "rejected" in errors[0]
    assert main(["reward", "score", "--workdir", str(small_base), "--texts", str(bad)]) == 2
    assert "not a reward model" in capsys.readouterr().err


@pytest.mark.slow
def test_kto_on_pairs_split_into_unpaired_examples_logs_trl_metrics_and_resumes_exactly(small_base, task, tmp_path):
    data = {split: tmp_path / f"unpaired_{split}.jsonl" for split in ("train", "heldout")}
    for split, path in data.items():
        unpaired_from_pairs(task[split], path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run("kto", small_base, data, straight, 6) == 0
    logged = rows(straight)
    trained = [r for r in logged if "loss" in r]
    names = {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "count/chosen"}
    assert trained and all(names <= r.keys() for r in trained)
    assert all(r["count/chosen"] + r["count/rejected"] == 8 for r in trained)
    assert any("eval_kl" in r for r in logged)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["data"]["desirable"] == summary["data"]["undesirable"] == 64
    assert run("kto", small_base, data, split, 3) == 0
    assert run("kto", small_base, data, split, 6, "--resume") == 0
    for x, y in zip(jax.tree.leaves(final_params(straight, 6)), jax.tree.leaves(final_params(split, 6))):
        np.testing.assert_array_equal(x, y)
