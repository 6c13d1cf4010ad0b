"""Generation on devices of its own (rl.generation_devices): the policy is copied to the
generation mesh after every update (bitwise, on those devices only), the update's donation never
touches the copy, and with a deliberately slow generator the learner does not wait for rollouts
once they are sampled ahead (rl.max_staleness >= 1)."""

import time

import jax
import numpy as np
import pytest

from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.train.rewards import RewardFn, Rewards
from lm.train.rl import build_rl_run, split_devices
from lm.train.rl_losses import RlSettings
from lm.train.rl_step import RlStep
from lm.train.rollout import Sampler, Scorer
from tests.train.test_rl import config, digit_share, prompt_set
from tests.train.test_rl_async import Stream, same

GENERATE, UPDATE = 0.5, 2.5  # seconds each side is made to take beyond its compute


def make(k: int, g: int = 4):
    c = config(beta=0.0, max_staleness=k, generation_devices=g)
    devices = jax.devices()[:8]
    run = build_rl_run(c, devices=devices)
    state, frozen = run.init(seed=5)
    prompts, template = prompt_set()
    _, mesh = split_devices(run.config, devices)
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=1.0)
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len, mesh=mesh)
    rewards = Rewards([RewardFn("digits", digit_share, 1.0)])
    scorer = Scorer(run, False, with_policy=k > 0)
    step = RlStep(run, frozen, prompts, rewards, sampler, scorer, template, RlSettings.from_config(c.rl), c.rl)
    stream = step.stream(Stream())
    return step, state, stream


def test_the_policy_is_copied_to_the_generation_devices_after_every_update():
    step, state, stream = make(1)
    train_devices, generate_devices = set(jax.devices()[:4]), set(jax.devices()[4:8])
    assert set(step.run.mesh.devices.flat) == train_devices
    handed = []
    produce = step.pipeline.produce
    step.pipeline.produce = lambda params, batch, s: handed.append((s, params)) or produce(params, batch, s)
    policies = []
    for _ in range(3):
        policies.append(jax.device_get(step.sampler._policy(state.params, step.frozen)))
        state, metrics = step(state, next(stream))
        assert np.isfinite(metrics["loss"])
    for future in step.pipeline.pending.values():
        future.result()
    assert [s for s, _ in handed] == [0, 1, 2, 3]
    for s, params in handed:
        for leaf in jax.tree.leaves(params):
            assert set(leaf.sharding.device_set) == generate_devices
        same(params, policies[max(0, s - 1)])  # sampled by the params of step s - 1 (k = 1)


def test_with_a_slow_generator_on_its_own_devices_the_learner_does_not_wait_when_sampling_ahead():
    step, state, stream = make(1)
    produce, update = step.pipeline.produce, step.update

    def slow_produce(params, batch, s):
        time.sleep(GENERATE)
        return produce(params, batch, s)

    def slow_update(state, batch):
        out = update(state, batch)
        jax.block_until_ready(out)
        time.sleep(UPDATE)
        return out

    step.pipeline.produce, step.update = slow_produce, slow_update
    waits = []
    for _ in range(4):
        state, metrics = step(state, next(stream))
        waits.append(metrics["rollout_wait_s"])
        assert 0.0 <= metrics["rollout_wait_share"] <= 1.0
    assert waits[0] >= GENERATE  # the first step has nothing sampled ahead
    # later steps' rollouts were sampled while the previous update ran: ready when needed
    assert max(waits[1:]) < GENERATE / 2, waits


def test_generation_devices_must_leave_devices_to_train_on():
    c = config(beta=0.0, generation_devices=8)
    with pytest.raises(UserError, match="rl.generation_devices=8 leaves none of the 8 devices"):
        split_devices(c, jax.devices()[:8])
    assert split_devices(config(beta=0.0), jax.devices()[:2]) == (jax.devices()[:2], None)
