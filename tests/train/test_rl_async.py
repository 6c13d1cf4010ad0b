"""Asynchronous rollouts (rl.max_staleness = k): step s trains on rollouts sampled with the params
of step max(0, s - k), exactly those a direct call with those params gives; each step's first
update has ratio 1 (the proximal log-probs are the current params'), the importance weights
correct for the sampler; a run resumed from a checkpoint (prompt stream + rollouts sampled
ahead, through JSON) equals the uninterrupted one bitwise, and sampling in turn (several
processes) equals sampling on the worker thread."""

import json

import jax
import numpy as np
import pytest

from lm.infer.sampling import SamplingParams
from lm.train.rewards import RewardFn, Rewards
from lm.train.rl import build_rl_run
from lm.train.rl_losses import RlSettings
from lm.train.rl_step import RlStep
from lm.train.rollout import Sampler, Scorer
from tests.train.test_rl import config, digit_share, prompt_set


class Stream:
    """Prompt batches of 4 indices, a different order each step; a position as its state."""

    def __init__(self):
        self.pos = 0

    def __next__(self):
        self.pos += 1
        return {"index": np.roll(np.arange(4, dtype=np.int32), self.pos)}

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def make(k: int, overlap: bool | None = None, temperature: float = 1.0):
    c = config(beta=0.1, max_staleness=k, temperature=temperature)
    run = build_rl_run(c, devices=jax.devices()[:1])
    base = build_rl_run(config(beta=0.0), devices=jax.devices()[:1]).init_state(seed=1).params
    state, frozen = run.init(seed=5, base=jax.device_get(base))
    prompts, template = prompt_set()
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=temperature)
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    scorer = Scorer(run, False, with_policy=k > 0)
    rewards = Rewards([RewardFn("digits", digit_share, 1.0)])
    step = RlStep(run, frozen, prompts, rewards, sampler, scorer, template, RlSettings.from_config(c.rl), c.rl)
    stream = step.stream(Stream())
    if k and overlap is not None:
        step.pipeline.overlap, step.pipeline._worker = overlap, step.pipeline._worker if overlap else None
    return step, state, stream


def train(step, state, stream, n: int):
    metrics = []
    for _ in range(n):
        state, m = step(state, next(stream))
        metrics.append(m)
    return state, metrics


def same(a, b):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_stale_rollouts_are_those_of_the_older_params_and_the_first_ratio_is_one():
    step, state, stream = make(1)
    produce, seen = step.produce, {}

    def spy(params, batch, s):
        out = produce(params, batch, s)
        seen[s] = (jax.device_get(params), batch, out.ro.rows["old_logp"].copy())  # (the step replaces it)
        return out

    step.pipeline.produce = spy
    policies, metrics = [jax.device_get(step.sampler.params(state.params, step.frozen))], []
    for _ in range(3):
        state, m = step(state, next(stream))
        policies.append(jax.device_get(step.sampler.params(state.params, step.frozen)))
        metrics.append(m)
    for future in step.pipeline.pending.values():  # step 3's was launched at step 2, on the worker
        future.result()
    assert sorted(seen) == [0, 1, 2, 3] and [m["staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    for s, version in ((0, 0), (1, 0), (2, 1)):  # steps 0 and 1: the initial params; step 2: after step 1
        same(seen[s][0], policies[version])
    again = produce(policies[1], seen[2][1], 2)  # what was sampled is what a direct call gives
    np.testing.assert_array_equal(again.ro.rows["old_logp"], seen[2][2])
    assert all(m["ratio"] == pytest.approx(1.0, abs=1e-5) for m in metrics)  # proximal = current params
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # sampled by the current params
    assert abs(metrics[1]["is_weight_mean"] - 1.0) > 1e-5  # sampled by older ones: corrected


def test_a_resumed_run_equals_the_uninterrupted_one_and_sampling_in_turn_equals_the_worker():
    step, state, stream = make(2)
    whole, metrics = train(step, state, stream, 4)
    step, state, stream = make(2)
    half, _ = train(step, state, stream, 2)
    saved = stream.get_state()  # what a checkpoint holds (rollouts of steps 2, 3)
    assert sorted(json.loads(saved)["rollouts"]) == ["2", "3"] and json.loads(saved)["stream"] == {"pos": 2}
    step, _, stream = make(2)
    stream.set_state(saved)
    resumed, resumed_metrics = train(step, jax.device_get(half), stream, 2)
    same(resumed.params, whole.params)
    same(resumed.opt_state, whole.opt_state)
    assert [m["reward"] for m in resumed_metrics] == [m["reward"] for m in metrics[2:]]
    step, state, stream = make(2, overlap=False)
    in_turn, _ = train(step, state, stream, 4)
    same(in_turn.params, whole.params)


def test_at_another_temperature_the_weights_divide_by_the_samplers_tempered_log_probs():
    step, state, stream = make(1, temperature=0.7)
    _, metrics = train(step, state, stream, 2)
    # step 0 was sampled by the current params: pi_current / pi_sampler at 0.7 is 1 (untempered: not)
    assert metrics[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics[0]["is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert abs(metrics[1]["is_weight_mean"] - 1.0) > 1e-5
