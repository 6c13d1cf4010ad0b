"""Preference losses under a 1F1B pipeline (lm.model.pipeline_1f1b): the pairs run inside the
schedule, each pair's chosen and rejected rows in one micro-batch, and the loss, its statistics
and every gradient equal the unpipelined loss on one device: DPO with precomputed and with live
reference log-probs, on 2 stages (x fsdp 2 x tensor 2) and interleaved on 4 stages (x data 2),
KTO (each example with its mismatched twin) and the Bradley-Terry reward model (its scalar head)
on 2 stages. KTO's KL estimate is each micro-batch's, so its reference sums the single-device
loss over the two pipeline micro-batches' pairs."""

import math

import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.config.dpo import DpoSettings
from lm.config.kto import KtoSettings
from lm.config.mesh import AXES
from lm.model.build import FrozenModel, reward_model
from lm.train.kto import kto_loss
from lm.train.pair_losses import dpo_loss, reward_loss
from lm.train.setup import build_run
from tests.model.test_pipeline import (
    CASES,
    assert_same_grads,
    needs_8_devices,
    packed_batch,
    pipeline_config,
    two_steps,
)

SETTINGS = {
    "precomputed": DpoSettings(
        loss="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.0, rpo_alpha=0.5, rpo_nll="per_response"
    ),
    "live": DpoSettings(
        loss="ipo", beta=0.2, label_smoothing=0.0, simpo_gamma=0.0, rpo_alpha=0.0, rpo_nll="per_response"
    ),
}


def pairs() -> dict:
    """The packed rows as 8 pairs [8, 2, T] (rows 2i and 2i+1), with reference log-probs."""
    rows = packed_batch()
    out = {k: v.reshape(v.shape[0] // 2, 2, *v.shape[1:]) for k, v in rows.items()}
    rng = np.random.default_rng(1)
    out["ref_logps"] = rng.normal(-40.0, 3.0, (rows["inputs"].shape[0] // 2, 2)).astype(np.float32)
    out["margin"] = rng.uniform(0.0, 1.0, rows["inputs"].shape[0] // 2).astype(np.float32)
    out["label"] = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)[: rows["inputs"].shape[0] // 2]  # KTO's
    return out


def loss_and_grads(case: str, reference: str, kind: str = "dpo"):
    mesh, model_kw, _ = CASES.get(case, ({}, {}, 1))
    c = pipeline_config(mesh, 1, **model_kw)
    r = build_run(c, devices=jax.devices()[: math.prod(c.mesh[a] for a in AXES)])
    params = jax.device_put(two_steps("reference")[0].params, r.state_shardings.params)
    frozen = {}
    if reference == "live":  # the reference: the init params moved a little, on the same mesh
        moved = jax.tree.map(lambda p: p * 1.01, params)
        frozen = {"reference": FrozenModel(r.model, moved)}
    if kind == "kto":
        loss = kto_loss(r.model, KtoSettings.from_config(base_config().kto), reference)
    else:
        loss = dpo_loss(r.model, SETTINGS[reference], reference)
    parts = [pairs()]
    if kind == "kto" and case == "reference":  # KL per pipeline micro-batch: micro-batch j holds pairs j, j+2, ...
        parts = [{k: v[j::2] for k, v in parts[0].items()} for j in range(2)]
    value = grads = None
    for batch in map(jax.device_put, parts):
        v = jax.jit(lambda p: loss(p, batch, frozen, None))(params)
        g = jax.jit(jax.grad(lambda p: loss(p, batch, frozen, None)[0]))(params)
        value, grads = (v, g) if value is None else jax.tree.map(lambda a, b: a + b, (value, grads), (v, g))
    return jax.device_get(value), jax.device_get(grads)


@needs_8_devices
@pytest.mark.parametrize(
    "case, reference, kind",
    [("1f1b-2stages", "precomputed", "dpo"), ("interleaved-4stages", "live", "dpo"), ("1f1b-2stages", "live", "kto")],
)
def test_dpo_and_kto_in_a_1f1b_pipeline_equal_one_device(case, reference, kind):
    (ref_obj, ref_sums), ref = loss_and_grads("reference", reference, kind)
    (obj, sums), got = loss_and_grads(case, reference, kind)
    assert float(ref_sums["count"]) == 8
    np.testing.assert_allclose(obj, ref_obj, rtol=1e-5)
    # rewards are differences of summed log-probs (~-80 a response): float32 rounding of those
    scale = float(abs(ref_sums["logps/chosen_sum"]) + abs(ref_sums["logps/rejected_sum"]))
    for k in ref_sums:
        np.testing.assert_allclose(sums[k], ref_sums[k], rtol=1e-5, atol=1e-7 * scale, err_msg=k)
    assert_same_grads(ref, got)


def reward_loss_and_grads(case: str):
    mesh, model_kw, _ = CASES.get(case, ({}, {}, 1))
    c = pipeline_config(mesh, 1, **model_kw)
    r = build_run(c, devices=jax.devices()[: math.prod(c.mesh[a] for a in AXES)], model_fn=reward_model)
    if case == "reference":  # a head that scores (it starts at zero: no gradient would reach the trunk)
        params = jax.device_get(r.init_state(0).params)
        kernel = params["scalar_head"]["kernel"]
        params["scalar_head"]["kernel"] = np.random.default_rng(2).normal(0.0, 0.5, kernel.shape).astype(kernel.dtype)
    else:
        params = jax.device_put(reward_loss_and_grads("reference")[2], r.state_shardings.params)
    loss = reward_loss(r.model, center_coef=0.01)
    batch = jax.device_put(pairs())
    value = jax.jit(lambda p: loss(p, batch, {}, None))(params)
    grads = jax.jit(jax.grad(lambda p: loss(p, batch, {}, None)[0]))(params)
    return jax.device_get(value), jax.device_get(grads), jax.device_get(params)


@needs_8_devices
def test_a_reward_model_in_a_1f1b_pipeline_equals_one_device():
    (ref_obj, ref_sums), ref, _ = reward_loss_and_grads("reference")
    (obj, sums), got, _ = reward_loss_and_grads("1f1b-2stages")
    assert float(ref_sums["count"]) == 8
    np.testing.assert_allclose(obj, ref_obj, rtol=1e-5)
    for k in ref_sums:
        np.testing.assert_allclose(sums[k], ref_sums[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert "scalar_head" in ref
    assert_same_grads(ref, got, zero=("['head']",))  # the LM head takes no gradient from a reward loss
