"""`lm rl` end to end from a small pretrained run: GRPO with a reward function from a file that
reads a prompt column, the metrics users read, held-out greedy rewards, the PNG, exact resume
(prompt stream, sampling keys and several updates per step), and one-line errors."""

import io
import json
import sys

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.data.synthetic import write_sort_task
from tests.e2e.test_cli_train import final_params

REWARD = '''
def overlap(prompts, completions, answer, **columns):
    """Share of the response's characters found in the reference answer (spread on an untrained model)."""
    return [sum(ch in a for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]
'''
COMMON = [
    "--config.rl.prompts_per_step=2",
    "--config.rl.group_size=4",
    "--config.rl.max_new_tokens=8",
    "--config.rl.epochs=2",
    "--config.rl.eval_prompts=4",
    "--config.eval.batch_size=4",
    "--config.eval.every_steps=2",
    "--config.checkpoint.every_steps=2",
    "--config.train.log_every=1",
    "--config.train.peak_flops=1e11",
    "--config.optim.lr=1e-3",
    "--no-progress",
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    (root / "rewards.py").write_text(REWARD)
    return write_sort_task(root, 16, 4) | {"rewards": f"{root / 'rewards.py'}:overlap"}


def run(base, task, workdir, steps, *extra):
    return main(
        [
            "rl",
            "--init",
            str(base),
            "--data",
            str(task["train"]),
            "--eval-data",
            str(task["heldout"]),
            "--rewards",
            task["rewards"],
            "--workdir",
            str(workdir),
            f"--config.train.steps={steps}",
            *COMMON,
            *extra,
        ]
    )


@pytest.mark.slow
def test_grpo_logs_rl_metrics_and_resumes_exactly(small_base, task, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run(small_base, task, straight, 4) == 0
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward" in r]
    keys = {
        "loss",
        "reward",
        "reward_std",
        "reward/overlap",
        "kl",
        "clip_fraction",
        "entropy",
        "response_length",
        "truncated",
        "zero_std_groups",
        "rollout_tokens_per_s",
        "update_tokens_per_s",
        "sampling_share",
        "grad_norm",
    }
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
    assert "rl.group_size" in error(
        "--data", str(task["train"]), "--rewards", task["rewards"], "--config.rl.group_size=1"
    )


BAD_REWARDS = """
def lookup(completions):
    return [{"a": 1.0, "c": 0.5}[c] for c in completions]


def picky(prompts, completions, **columns):  # raises on completion "b" only
    return lookup(completions)


def pairs(prompts, completions, **columns):  # raises on batches, never on one completion alone
    assert len(completions) == 1, "more than one"
    return [1.0]


def constant(prompts, completions, **columns):
    return 1.0
"""


def _reward(tmp_path, name):
    from lm.train.rewards import parse_rewards

    path = tmp_path / "bad_rewards.py"
    path.write_text(BAD_REWARDS)
    return parse_rewards(f"{path}:{name}")[0]


def test_a_raising_reward_function_names_itself_the_completion_and_its_own_traceback(tmp_path):
    from lm.errors import UserError
    from lm.train.rewards import call_reward

    picky = _reward(tmp_path, "picky")
    with pytest.raises(UserError) as e:
        call_reward(picky, ["p0", "p1", "p2"], ["a", "b", "c"], {"answer": ["x", "y", "z"]})
    first, *trace = str(e.value).split("\n")
    assert first == (
        f"reward function 'picky' ({tmp_path / 'bad_rewards.py'}:picky) raised KeyError on completion 1 "
        "of 3 (prompt 'p1'): 'b'"
    )
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "KeyError: 'b'"
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    assert [f.rpartition(" in ")[2] for f in frames][:2] == ["picky", "lookup"]
    assert all(str(tmp_path) in f for f in frames)  # the user's frames only
    with pytest.raises(
        UserError,
        match=r"'pairs' .* raised AssertionError on a batch of 2 completions \(on none "
        r"of them alone\): more than one\nTraceback",
    ):
        call_reward(_reward(tmp_path, "pairs"), ["p0", "p1"], ["a", "b"], {})


def test_reward_values_that_are_not_one_finite_float_per_completion_are_named(tmp_path):
    from lm.errors import UserError
    from lm.train.rewards import RewardFn, reward_values

    f = RewardFn("judge", None, 1.0, "mine.py:judge")
    cases = {
        (1.0, float("nan"), 0.0): r"'judge' \(mine.py:judge\) returned nan for completion 1; expected a finite",
        (float("-inf"), 1.0, 0.0): "returned -inf for completion 0",
        (1.0, 2.0): "returned 2 values for 3 completions",
        (1.0, None, 2.0): "returned None for completion 1; expected a float",
    }
    for out, message in cases.items():
        with pytest.raises(UserError, match=message):
            reward_values(f, list(out), 3)
    with pytest.raises(UserError, match="returned float 1.0 for 3 completions; expected a list of 3 floats"):
        reward_values(f, 1.0, 3)
    np.testing.assert_array_equal(reward_values(f, np.array([[1], [0], [2]]), 3), [1.0, 0.0, 2.0])


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_reward_function_error_starts_on_its_own_line_after_the_progress_bar(small_base, task, tmp_path, monkeypatch):
    (tmp_path / "boom.py").write_text(
        "def boom(prompts, completions, **columns):\n    return [1 / 0 for _ in completions]\n"
    )
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # progress bars are drawn on terminals only
    # the bar is drawn before the first rollout (no held-out rewards at step 0, which come before it)
    args = [a for a in COMMON if a != "--no-progress" and not a.startswith("--config.eval.every_steps")]
    assert (
        main(
            [
                "rl",
                "--init",
                str(small_base),
                "--data",
                str(task["train"]),
                "--rewards",
                f"{tmp_path / 'boom.py'}:boom",
                "--workdir",
                str(tmp_path / "w"),
                "--config.train.steps=2",
                "--config.eval.every_steps=0",
                *args,
            ]
        )
        == 2
    )
    err = terminal.getvalue()
    assert "0/2" in err  # the bar was drawn
    lines = err.split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith("lm: error: reward function 'boom'")]
    assert len(at) == 1 and "on completion 0 of 8" in lines[at[0]]
    assert lines[at[0] + 1] == "Traceback (most recent call last):"
    assert lines[at[0] + 2].strip().startswith(f'File "{tmp_path / "boom.py"}", line 2, in ')
    assert "ZeroDivisionError: division by zero" in lines[at[0] + 3 :]


@pytest.mark.slow
def test_stale_rollouts_resume_exactly_through_checkpoints(small_base, task, tmp_path):
    """rl.max_staleness=1, sampled on 4 devices of their own: the rollouts sampled ahead go into the
    checkpoint with the prompt stream."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    stale = ("--config.rl.max_staleness=1", "--config.rl.generation_devices=4")
    assert run(small_base, task, straight, 4, *stale) == 0
    logged = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "reward" in r]
    assert [r["staleness"] for r in logged] == [0.0, 1.0, 1.0, 1.0]
    expected = {"is_weight_mean", "is_weight_max", "is_capped_fraction", "rollout_wait_s", "rollout_wait_share"}
    assert all(expected <= r.keys() for r in logged)
    assert run(small_base, task, split, 2, *stale) == 0
    assert run(small_base, task, split, 4, *stale, "--resume") == 0
    for x, y in zip(jax.tree.leaves(final_params(straight, 4)), jax.tree.leaves(final_params(split, 4))):
        np.testing.assert_array_equal(x, y)
