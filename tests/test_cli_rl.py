"""`lm rl` end to end from a small pretrained run: GRPO with a reward function from a file that
reads a prompt column, the metrics users read, held-out greedy rewards, the PNG, exact resume
(prompt stream, sampling keys and several updates per step), and one-line errors."""

import json

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_task
from tests.test_cli_train import final_params

REWARD = '''
def overlap(prompts, completions, answer, **columns):
    """Share of the response's characters found in the reference answer (spread on an untrained model)."""
    return [sum(ch in a for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]
'''
COMMON = ["--config.rl.prompts_per_step=2", "--config.rl.group_size=4", "--config.rl.max_new_tokens=8",
          "--config.rl.epochs=2", "--config.rl.eval_prompts=4", "--config.eval.batch_size=4",
          "--config.eval.every_steps=2", "--config.checkpoint.every_steps=2", "--config.train.log_every=1",
          "--config.train.peak_flops=1e11", "--config.optim.lr=1e-3", "--no-progress"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    (root / "rewards.py").write_text(REWARD)
    return write_sort_task(root, 16, 4) | {"rewards": f"{root / 'rewards.py'}:overlap"}


def run(base, task, workdir, steps, *extra):
    return main(["rl", "--init", str(base), "--data", str(task["train"]), "--eval-data", str(task["heldout"]),
                 "--rewards", task["rewards"], "--workdir", str(workdir), f"--config.train.steps={steps}",
                 *COMMON, *extra])


@pytest.mark.slow
def test_grpo_logs_rl_metrics_and_resumes_exactly(small_base, task, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run(small_base, task, straight, 4) == 0
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward" in r]
    keys = {"loss", "reward", "reward_std", "reward/overlap", "kl", "clip_fraction", "entropy", "response_length",
            "truncated", "zero_std_groups", "rollout_tokens_per_s", "update_tokens_per_s", "sampling_share",
            "grad_norm"}
    assert len(logged) == 4 and all(keys <= r.keys() for r in logged)
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-4)  # the first rollouts come from the reference
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(0 <= r["eval_reward/overlap"] <= 1 for r in evals)
    assert (straight / "rl.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((straight / "summary.json").read_text())["algo"] == "grpo"
    # warmup (10 steps) covers the run, so stopping at 2 changes no learning rate
    assert run(small_base, task, split, 2) == 0
    assert run(small_base, task, split, 4, "--resume") == 0
    for x, y in zip(jax.tree.leaves(final_params(straight, 4)), jax.tree.leaves(final_params(split, 4))):
        np.testing.assert_array_equal(x, y)


def test_bad_prompts_and_rewards_are_one_line_errors(small_base, task, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "sort 21"}\n{"promt": "sort 3"}\n')
    args = ["rl", "--init", str(small_base), "--workdir", str(tmp_path / "w"), *COMMON]

    def error(*extra):
        assert main([*args, *extra]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lm: error:")]
        assert len(errors) == 1
        return errors[0]

    assert f"{bad}:2" in error("--data", str(bad), "--rewards", task["rewards"])
    assert "rl.rewards" in error("--data", str(task["train"]), "--rewards", "no_such_module:fn")
    assert "no reward" in error("--data", str(task["train"]))
    assert "rl.group_size" in error("--data", str(task["train"]), "--rewards", task["rewards"],
                                    "--config.rl.group_size=1")
