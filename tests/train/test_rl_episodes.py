"""A GRPO step on multi-turn episodes (rl.environment): the update trains on the sampled answers
only, starts at ratio 1 with no KL (the sampler's log-probs are the policy's on the episode rows),
logs each reward term and how episodes ended, and on a (2,2,2) mesh equals one device."""

import json

import jax
import numpy as np
import pytest

from lm.config import base_config, validate
from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.train.environments import Step
from lm.train.episodes import EpisodeRollouts, Limits
from lm.train.rl import build_rl_run
from lm.train.rl_losses import RlSettings
from lm.train.rl_step import RlStep, evaluator
from lm.train.rollout import Sampler, Scorer
from tests.train.test_episodes import Stops
from tests.train.test_rl import config, prompt_set

T = 192


class Chars:
    """Asks for more; each answer earns its length in characters over 8 (a reward with spread)."""

    tools = []

    def reset(self, example):
        return list(example["messages"])

    def step(self, messages, turn):
        return Step([{"role": "user", "content": "more"}], {"chars": len(turn["content"]) / 8})


def episode_config(beta=0.1, **rl):
    c = config(beta=beta, **rl)
    c.model.max_seq_len = c.data.seq_len = T
    c.rl.update(environment="tests.train.test_rl_episodes:Chars", max_turns=3)
    return c


def rl_step(c, devices):
    run = build_rl_run(c, devices=devices)
    base = build_rl_run(episode_config(beta=0.0), devices=devices[:1]).init_state(seed=1).params
    state, frozen = run.init(seed=5, base=jax.device_get(base))
    prompts, template = prompt_set()
    template = Stops(template)  # answers end within a few tokens: several turns per episode
    settings = RlSettings.from_config(c.rl)
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=c.rl.temperature)
    sampler = Sampler(run, sampling, template.stop_ids, T)
    episodes = EpisodeRollouts(sampler, template, Chars, Limits(c.rl.max_turns), T)
    step = RlStep(run, frozen, prompts, None, sampler, Scorer(run, False), template, settings, c.rl, episodes)
    state, metrics = step(state, {"index": np.arange(4, dtype=np.int32)})
    return jax.device_get(state), metrics, step


def test_a_multi_turn_grpo_step_starts_at_ratio_one_and_on_a_mesh_equals_one_device():
    one, m1, step = rl_step(episode_config(), jax.devices()[:1])
    assert m1["ratio"] == pytest.approx(1.0, abs=1e-5) and m1["kl"] == pytest.approx(0.0, abs=1e-5)
    assert m1["episode/turns"] > 1 and m1["reward/chars"] == m1["reward"] and m1["reward_std"] > 0
    assert sum(m1[f"episode/end/{k}"] for k in ("done", "length", "turns", "tokens", "tool_time")) == pytest.approx(1)
    c8 = episode_config()
    c8.mesh.update(data=2, fsdp=2, tensor=2)
    eight, m8, _ = rl_step(c8, jax.devices()[:8])
    for k in ("reward", "response_length", "episode/turns"):
        assert m8[k] == pytest.approx(m1[k], rel=1e-6), k
    for k in ("loss", "kl", "clip_fraction", "entropy"):
        assert m8[k] == pytest.approx(m1[k], rel=1e-3, abs=1e-6), k
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one.params, eight.params)
    prompts, _ = prompt_set()
    held_out = evaluator(step, prompts, 2, 2)(one)
    assert {"eval_reward", "eval_reward/chars", "eval_episode/turns", "eval_episode/end/turns"} <= held_out.keys()


def test_an_environment_gives_the_rewards_itself():
    c = base_config()
    c.rl.update(environment="calculator", rewards="m:f")
    with pytest.raises(UserError, match="rl.environment.*leave rl.rewards empty"):
        validate(c)
    c.rl.update(rewards="", max_episode_tokens=c.data.seq_len + 1)
    with pytest.raises(UserError, match="rl.max_episode_tokens"):
        validate(c)


@pytest.mark.slow
def test_lm_rl_with_an_environment(small_base, tmp_path, capsys):
    """`lm rl --config.rl.environment=module:Class`: episodes' metrics and held-out episodes in
    metrics.jsonl; the calculator's tools do not fit this small model's context: one clear line."""
    from lm.cli import main
    from lm.data.synthetic import write_sort_task

    task = write_sort_task(tmp_path, 16, 4)
    args = ["rl", "--init", str(small_base), "--data", str(task["train"]), "--eval-data", str(task["heldout"])]
    args += ["--workdir", str(tmp_path / "w"), "--no-progress"]
    args += [f"--config.{k}" for k in ("rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=8")]
    args += [f"--config.{k}" for k in ("rl.eval_prompts=4", "eval.batch_size=4", "eval.every_steps=2")]
    args += [f"--config.{k}" for k in ("train.steps=2", "train.log_every=1", "rl.max_turns=2")]
    assert main(args + ["--config.rl.environment=tests.train.test_rl_episodes:Chars"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward" in r]
    assert len(logged) == 2
    ends = [f"episode/end/{k}" for k in ("done", "length", "turns", "tokens", "tool_time")]
    for r in logged:
        assert sum(r[k] for k in ends) == pytest.approx(1.0) and r["episode/turns"] >= 1
    assert [r["eval_episode/turns"] >= 1 for r in rows if "eval_reward" in r] == [True, True]
    capsys.readouterr()
    assert main(args + ["--workdir", str(tmp_path / "w2"), "--config.rl.environment=calculator"]) != 0
    assert "rl.environment: no episode had room for an answer" in capsys.readouterr().err
