"""Online DPO: pairs ranked by hand (best first of equals, worst last of equals, no preference as
padding), a step's update equal to a DPO step on the pairs it sampled, and `lm online-dpo` end to
end with an exact resume."""

import json

import jax
import numpy as np
import pytest

from lm.cli import main
from lm.infer.sampling import SamplingParams
from lm.train.online_dpo import OnlineDpoStep, build_online_dpo_run, ranked_pairs
from lm.train.rewards import RewardFn, Rewards
from lm.train.rollout import Rollouts, Sampler
from lm.train.setup import build_run
from tests.e2e.test_cli_rl import task  # noqa: F401 (the fixture)
from tests.e2e.test_cli_train import final_params
from tests.train.test_rl import config, digit_share, prompt_set
from tests.train.test_rl_async import Stream


def test_each_group_gives_its_best_and_worst_and_no_preference_is_padding():
    n, t = 9, 5
    rows = {k: np.arange(n * t, dtype=np.int32).reshape(n, t) + 100 * j for j, k in enumerate(("inputs", "targets"))}
    rows |= {k: np.full((n, t), i + 1, np.int32) for i, k in enumerate(("segment_ids", "positions"))}
    rows["loss_mask"] = np.ones((n, t), np.float32)
    ro = Rollouts(rows, [np.arange(2)] * n, ["eos"] * n)
    total = np.array([0.5, 1.0, 1.0, 0.3, 0.3, 0.3, 0.2, np.nan, np.nan], np.float32)
    pairs, metrics = ranked_pairs(ro, total, group=3)
    # group 0: best is row 1 (first of the two 1.0s), worst row 0; groups 1 (all equal) and 2 (one finite): padding
    np.testing.assert_array_equal(pairs["inputs"][0], rows["inputs"][[1, 0]])
    assert not pairs["loss_mask"][1:].any() and not pairs["inputs"][1:].any()
    assert metrics["pairs_used"] == 1.0 and metrics["no_preference"] == pytest.approx(2 / 3)
    assert (metrics["reward/chosen_score"], metrics["reward/rejected_score"]) == (1.0, 0.5)
    pairs, _ = ranked_pairs(ro, np.array([0.1, 0.9, 0.1] * 3, np.float32), group=3)
    np.testing.assert_array_equal(pairs["inputs"][0], rows["inputs"][[1, 2]])  # the worst: last of equals


def test_a_step_is_a_dpo_update_on_the_pairs_it_sampled_and_ranked():
    c = config()  # 4 prompts x 4 responses; dpo.beta: DPO's 0.1
    run = build_online_dpo_run(c, devices=jax.devices()[:1])
    base = build_run(config(), devices=jax.devices()[:1]).init_state(seed=1).params
    state, frozen = run.init(seed=5, base=jax.device_get(base))  # the policy starts as its reference
    prompts, template = prompt_set()
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=1.0)
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    rewards = Rewards([RewardFn("digits", digit_share, 1.0)])
    step = OnlineDpoStep(run, frozen, prompts, rewards, sampler, template, c.rl)
    batch = next(Stream())
    rollout = step.produce(step.sampler.params(state.params, frozen), batch, 0)
    pairs, ranked = ranked_pairs(rollout.ro, rollout.total, 4)
    direct, m_direct = step.update(jax.device_get(state), step.placer.from_global(pairs))
    after, m = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.params), jax.device_get(direct.params))
    assert m["pairs"] == ranked["pairs_used"] > 0 and m["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    assert m["loss"] == float(m_direct["loss"]) and m["reward/digits"] == pytest.approx(np.nanmean(rollout.total))


def online_dpo(base, data, workdir, steps, *extra):
    return main(
        [
            "online-dpo",
            "--init",
            str(base),
            "--data",
            str(data["train"]),
            "--eval-data",
            str(data["heldout"]),
            "--rewards",
            data["rewards"],
            "--workdir",
            str(workdir),
            f"--config.train.steps={steps}",
            "--config.rl.prompts_per_step=8",
            "--config.rl.group_size=4",
            "--config.rl.max_new_tokens=8",
            "--config.rl.eval_prompts=4",
            "--config.eval.batch_size=4",
            "--config.eval.every_steps=2",
            "--config.checkpoint.every_steps=2",
            "--config.train.log_every=1",
            "--config.train.peak_flops=1e11",
            "--config.optim.lr=1e-3",
            "--no-progress",
            *extra,
        ]
    )


@pytest.mark.slow
def test_lm_online_dpo_logs_dpo_and_reward_metrics_and_resumes_exactly(small_base, task, tmp_path):  # noqa: F811
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert online_dpo(small_base, task, straight, 4) == 0
    logged = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in logged if "loss" in r]
    keys = {"rewards/margins", "rewards/accuracies", "reward", "pairs_used", "no_preference", "reward_failed"}
    assert len(trained) == 4 and all(keys <= r.keys() for r in trained)
    assert any("eval_reward" in r for r in logged)
    assert online_dpo(small_base, task, split, 2) == 0
    assert online_dpo(small_base, task, split, 4, "--resume") == 0
    for x, y in zip(jax.tree.leaves(final_params(straight, 4)), jax.tree.leaves(final_params(split, 4))):
        np.testing.assert_array_equal(x, y)
