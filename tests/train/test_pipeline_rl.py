"""RL losses under a 1F1B pipeline (lm.model.pipeline_1f1b): GRPO (DAPO's token sum, k3 to the
reference, the asynchronous importance weights) and PPO (its value head and clipped value loss)
run per pipeline micro-batch on the last stage; the loss, its statistics and every gradient
equal the unpipelined loss on one device."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.config.mesh import AXES
from lm.config.rl import RlSettings
from lm.model.build import reward_model
from lm.train.rl_losses import rl_loss
from lm.train.setup import build_run
from tests.model.test_pipeline import CASES, assert_same_grads, needs_8_devices, packed_batch, pipeline_config


def settings(algo: str) -> RlSettings:
    base = RlSettings.from_config(base_config().rl)
    if algo == "grpo":
        return dataclasses.replace(base, algo="grpo", loss_type="dapo", beta=0.05, temperature=0.9)
    return dataclasses.replace(base, algo="ppo", loss_type="grpo", beta=0.0, vf_coef=0.5, value_clip=0.2)


def rollouts() -> dict:
    """The packed rows as a rollout batch: log-probs of the sampler and the reference, advantages,
    importance weights, values and returns (random, masked like the loss mask)."""
    b = packed_batch()
    rng, mask = np.random.default_rng(3), b["loss_mask"]
    noise = lambda scale: (scale * rng.normal(size=mask.shape) * mask).astype(np.float32)  # noqa: E731
    return b | {
        "old_logp": noise(1.0) - 4.0 * mask,
        "ref_logp": noise(1.0) - 4.0 * mask,
        "advantages": (rng.normal(size=(mask.shape[0], 1)) * mask).astype(np.float32),
        "is_weight": (1.0 + noise(0.1)).astype(np.float32),
        "old_values": noise(0.5),
        "returns": noise(0.5),
    }


def loss_and_grads(case: str, algo: str, start=None):
    mesh, model_kw, _ = CASES.get(case, ({}, {}, 1))
    c = pipeline_config(mesh, 1, **model_kw)
    fn = reward_model if algo == "ppo" else None  # PPO's value head
    r = build_run(c, devices=jax.devices()[: math.prod(c.mesh[a] for a in AXES)], **({"model_fn": fn} if fn else {}))
    if start is None:
        start = jax.device_get(r.init_state(0).params)
        if algo == "ppo":  # a value head that is not zero, so its loss reaches the trunk
            kernel = start["scalar_head"]["kernel"]
            start["scalar_head"]["kernel"] = np.random.default_rng(2).normal(0, 0.5, kernel.shape).astype(kernel.dtype)
    params = jax.device_put(start, r.state_shardings.params)
    loss = rl_loss(r.model, settings(algo))
    batch = jax.device_put(rollouts())
    value = jax.jit(lambda p: loss(p, batch, {}, None))(params)
    grads = jax.jit(jax.grad(lambda p: loss(p, batch, {}, None)[0]))(params)
    return jax.device_get(value), jax.device_get(grads), start


@needs_8_devices
@pytest.mark.parametrize("case, algo", [("1f1b-2stages", "grpo"), ("interleaved-4stages", "ppo")])
def test_rl_in_a_1f1b_pipeline_equals_one_device(case, algo):
    (ref_obj, ref_sums), ref, start = loss_and_grads("reference", algo)
    (obj, sums), got, _ = loss_and_grads(case, algo, start)
    np.testing.assert_allclose(obj, ref_obj, rtol=1e-5)
    for k in ref_sums:  # a clip count may move by a token whose value sits on the clip's edge
        atol = 1.0 if "clip_fraction" in k else 1e-6
        np.testing.assert_allclose(sums[k], ref_sums[k], rtol=1e-5, atol=atol, err_msg=k)
    assert_same_grads(ref, got)
