"""Failed rewards in RL: a NaN reward leaves its row out of its GRPO group (the others' advantages
are those of the group without it) and out of PPO's advantages; a tiny-model GRPO step scored by
a local HTTP endpoint (`rl.reward_url`) logs `reward/http`, trains without the rows the endpoint
answered null for, reports held-out failures, and stops with one line past rl.max_reward_failures."""

import json

import jax
import numpy as np
import pytest

from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.train.rewards import Rewards
from lm.train.rl import build_rl_run
from lm.train.rl_losses import RlSettings, group_advantages
from lm.train.rl_step import RlStep, advantages, evaluator
from lm.train.rollout import Rollouts, Sampler, Scorer
from tests.train.rewards_server import Reply, RewardServer, digit_share
from tests.train.test_rl import config, prompt_set, rl_settings
from tests.train.test_rl_async import Stream


def test_a_failed_reward_leaves_its_group_as_if_the_row_were_not_there():
    rewards = np.array([1.0, np.nan, 0.0, 0.5, 2.0, np.nan, np.nan, np.nan])
    for scale in (True, False):
        adv = group_advantages(rewards, 4, scale=scale)
        np.testing.assert_allclose(adv[[0, 2, 3]], group_advantages(np.array([1.0, 0.0, 0.5]), 3, scale=scale))
        assert adv[1] == 0.0
        np.testing.assert_array_equal(adv[4:], 0.0)  # one reward left: nothing to compare it with
    np.testing.assert_allclose(  # no failure: the plain formula
        group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), 4), np.array([0.5, -0.5, -0.5, 0.5]) / (np.sqrt(1 / 3) + 1e-4)
    )


def test_ppo_advantages_leave_a_failed_row_out():
    mask = np.zeros((3, 6), np.float32)
    mask[:, 2:5] = 1.0
    mask[1] = 0.0  # the failed row, masked out by the step
    ro = Rollouts({"loss_mask": mask, "old_logp": np.zeros_like(mask)}, [], [])
    scored = {"old_values": np.full_like(mask, 0.1) * mask}
    fields, metrics = advantages(
        rl_settings(algo="ppo", beta=0.0), ro, np.array([1.0, np.nan, -1.0], np.float32), scored, 1
    )
    assert np.all(np.isfinite(fields["advantages"])) and np.all(fields["advantages"][1] == 0)
    assert np.all(np.isfinite(fields["returns"])) and np.isfinite(metrics["explained_variance"])
    ro.rows["loss_mask"] = np.zeros_like(mask)  # every row failed: nothing to whiten, and no NaN
    fields, metrics = advantages(rl_settings(algo="ppo", beta=0.0), ro, np.full(3, np.nan, np.float32), scored, 1)
    assert np.all(fields["advantages"] == 0) and np.all(fields["returns"] == 0)
    assert all(np.isfinite(v) for v in metrics.values())


def null_for_the_first_row(batch: dict) -> dict:
    return {"rewards": [None] + digit_share(batch)["rewards"][1:]}


def endpoint_step(url: str, max_failures: float):
    c = config(beta=0.0, reward_url=url, reward_retries=0, max_reward_failures=max_failures)
    run = build_rl_run(c, devices=jax.devices()[:1])
    state, frozen = run.init(seed=5)
    prompts, template = prompt_set()
    settings = RlSettings.from_config(c.rl)
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=c.rl.temperature)
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    step = RlStep(
        run, frozen, prompts, Rewards.from_config(c.rl), sampler, Scorer(run, False), template, settings, c.rl
    )
    seen = []
    update = step.update

    def recording(state, mb):  # the rows each update trains on
        seen.append(jax.device_get({k: mb[k] for k in ("loss_mask", "advantages")}))
        return update(state, mb)

    step.update = recording
    return state, step, seen, prompts


def test_an_rl_step_scored_by_an_endpoint_trains_without_its_null_rows():
    with RewardServer(Reply(body=null_for_the_first_row), Reply(body=null_for_the_first_row)) as server:
        state, step, seen, prompts = endpoint_step(server.url, max_failures=0.1)
        state, m = step(state, {"index": np.arange(4, dtype=np.int32)})
        assert len(server.requests) == 1 and len(server.requests[0]["completions"]) == 16  # one POST per batch
        assert m["reward_failed"] == 1.0 and m["reward/http/failed"] == 1.0
        assert m["reward_failed_share"] == pytest.approx(1 / 16)
        assert np.isfinite(m["reward/http"]) and m["reward"] == pytest.approx(m["reward/http"])
        assert np.isfinite(m["loss"]) and int(jax.device_get(state.step)) == 1
        (rows,) = seen
        assert rows["loss_mask"][0].sum() == 0 and np.all(rows["advantages"][0] == 0)  # out of the update
        assert all(rows["loss_mask"][i].sum() > 0 for i in range(1, 16))
        evaluate = evaluator(step, prompts, limit=4, batch_size=4)(state)  # held-out: one POST of 4
        assert evaluate["eval_reward_failed"] == 1.0 and evaluate["eval_reward/http/failed"] == 1.0
        assert np.isfinite(evaluate["eval_reward/http"])
        server.script.append(Reply(body=lambda b: {"rewards": [None] * len(b["completions"])}))
        with pytest.raises(UserError) as e:  # 17 of 32 failed: past 0.1
            step(state, {"index": np.arange(4, dtype=np.int32)})
    assert str(e.value) == (
        "rl: the rewards of 16 of 16 rollouts failed this step (17 of 32, 53.1%, since the run started; "
        f"rl.max_reward_failures=0.1): {server.url} returned null for 16 of 16 completions"
    )


def test_the_failure_count_is_in_the_checkpointed_stream_state_and_goes_on_after_a_resume():
    with RewardServer(Reply(body=null_for_the_first_row)) as server:
        state, step, _, _ = endpoint_step(server.url, max_failures=0.1)
        stream = step.stream(Stream())
        state, m = step(state, next(stream))
        saved = json.loads(stream.get_state())
        assert saved["failures"] == {"failed": 1, "seen": 16} and saved["stream"] == {"pos": 1}
        _, resumed, _, _ = endpoint_step(server.url, max_failures=0.1)
        stream = resumed.stream(Stream())
        stream.set_state(json.dumps(saved).encode())
        _, m = resumed(state, next(stream))
    assert m["reward_failed_share"] == pytest.approx(2 / 32)  # counted since the run started, not the resume
    stream.set_state({"pos": 3})  # a checkpoint written when the stream was the prompts' own
    assert stream.stream.pos == 3 and json.loads(stream.get_state())["failures"] == {"failed": 2, "seen": 32}


@pytest.mark.slow
def test_lm_rl_scored_by_an_endpoint_logs_its_rewards(small_base, tmp_path):
    """`lm rl` with only rl.reward_url: the endpoint's rewards in the metrics, held-out ones too."""
    from lm.cli import main
    from lm.data.synthetic import write_sort_task

    task = write_sort_task(tmp_path, 16, 4)
    with RewardServer() as server:
        code = main(
            [
                "rl",
                "--init",
                str(small_base),
                "--data",
                str(task["train"]),
                "--eval-data",
                str(task["heldout"]),
                "--workdir",
                str(tmp_path / "w"),
                f"--config.rl.reward_url={server.url}",
                "--config.rl.reward_weight=2.0",
                "--config.rl.prompts_per_step=2",
                "--config.rl.group_size=4",
                "--config.rl.max_new_tokens=8",
                "--config.rl.eval_prompts=4",
                "--config.eval.batch_size=4",
                "--config.eval.every_steps=2",
                "--config.train.steps=2",
                "--config.train.log_every=1",
                "--no-progress",
            ]
        )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward" in r]
    assert len(logged) == 2
    for r in logged:
        assert r["reward"] == pytest.approx(2.0 * r["reward/http"], rel=1e-5)
        assert r["reward/http/failed"] == 0 and r["reward_failed"] == 0 and r["reward_failed_share"] == 0
    assert [r["eval_reward_failed"] for r in rows if "eval_reward" in r] == [0.0, 0.0]
    # one POST per rollout batch (8 completions) and per held-out batch (4)
    assert sorted({len(b["completions"]) for b in server.requests}) == [4, 8]
    assert all(set(b) == {"prompts", "completions", "columns"} and "answer" in b["columns"] for b in server.requests)
