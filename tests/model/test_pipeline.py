"""Pipelined training on 8 simulated CPU devices matches the unpipelined single-device run.

GPipe, circular, 1F1B and interleaved 1F1B schedules over 2 and 4 stages, with remat and
gradient accumulation, take two train steps from the same initial state; their losses,
gradient norms and params equal the reference's, and 1F1B's gradients equal it leaf by leaf.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import rules_table, validate
from lm.config.mesh import AXES
from lm.errors import UserError
from lm.model.build import build_model
from lm.model.cache import decode_step, init_cache
from lm.model.layers import Partitioning
from lm.model.pipeline import bubble_fraction, check, is_pipelined, stage_layers
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.sharding import make_mesh, per_device_bytes
from lm.train.losses import pretrain_loss
from lm.train.setup import build_run
from tests.test_sharding import T, config, make_batch, put

N_LAYERS = 8
# sliding-window layers in no pattern a stage split repeats: their flags must travel with the layers
LAYER_TYPES = ("local", "local", "global", "local", "global", "global", "local", "global")
# name: (mesh axes, model fields, train.micro_batches)
CASES = {
    "gpipe-2stages": (dict(stage=2, fsdp=2, tensor=2), dict(remat="full"), 2),
    "gpipe-4stages": (dict(stage=4, data=2), dict(pipeline_microbatches=4, remat="dots_saveable"), 1),
    "circular-2stages": (
        dict(stage=2, fsdp=2, tensor=2),
        dict(pipeline_repeats=2, pipeline_microbatches=4, remat="full"),
        2,
    ),
    "circular-4stages": (dict(stage=4, data=2), dict(pipeline_repeats=2), 2),
    "1f1b-2stages": (dict(stage=2, fsdp=2, tensor=2), dict(remat="full", pipeline_schedule="1f1b"), 2),
    "1f1b-4stages": (
        dict(stage=4, data=2),
        dict(pipeline_microbatches=8, remat="dots_saveable", pipeline_schedule="1f1b"),
        1,
    ),
    "interleaved-2stages": (
        dict(stage=2, fsdp=2, tensor=2),
        dict(pipeline_repeats=2, pipeline_microbatches=4, remat="full", pipeline_schedule="1f1b"),
        2,
    ),
    "interleaved-4stages": (dict(stage=4, data=2), dict(pipeline_repeats=2, pipeline_schedule="1f1b"), 2),
}


def pipeline_config(mesh=None, micro=1, **model_kw):
    c = config(n_layers=N_LAYERS, layer_types=LAYER_TYPES, sliding_window=4, **model_kw)
    c.mesh.update(dict(data=1, stage=1, fsdp=1, expert=1, tensor=1) | (mesh or {}))
    c.train.micro_batches = micro
    validate(c)
    return c


def packed_batch():
    """Rows whose documents split at different places: segment ids and RoPE positions must
    travel with their micro-batch."""
    out = make_batch()
    for r in range(out["inputs"].shape[0]):
        cut = 2 + 5 * r % 13
        out["segment_ids"][r] = np.where(np.arange(T) < cut, 1, 2)
        out["positions"][r] = np.where(np.arange(T) < cut, np.arange(T), np.arange(T) - cut)
    return out


@functools.cache
def two_steps(case):
    """Host copies of (initial state, state after two steps, both steps' metrics) and the
    block params' bytes on one device, for a case or the single-device "reference"."""
    mesh, model_kw, micro = CASES.get(case, ({}, {}, 1))
    c = pipeline_config(mesh, micro, **model_kw)
    r = build_run(c, devices=jax.devices()[: math.prod(c.mesh[a] for a in AXES)])
    state = r.init_state(0) if case == "reference" else jax.device_put(two_steps("reference")[0], r.state_shardings)
    init = jax.device_get(state)  # before the step donates it
    step, batch = r.train_step(), put(r, packed_batch())
    state, m1 = step(state, batch)
    blocks_bytes = per_device_bytes(state.params["blocks"])
    state, m2 = step(state, batch)
    return init, jax.device_get(state), jax.device_get((m1, m2)), blocks_bytes


# meshes of up to 8 devices: the simulated CPU devices of the suite (one accelerator has one)
needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


@needs_8_devices
@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_steps_match_single_device(case):
    init, ref, ref_metrics, ref_bytes = two_steps("reference")
    _, got, metrics, blocks_bytes = two_steps(case)
    for ref_m, got_m in zip(ref_metrics, metrics):
        for k in ("loss", "grad_norm", "tokens"):
            np.testing.assert_allclose(got_m[k], ref_m[k], rtol=1e-5, err_msg=k)
    # Adam's first steps are ~ lr * sign(g): rounding in tiny gradients moves a param by up to
    # ~1e-3 of its update, so the tolerance is relative to how far the reference moved it.
    flat_ref = jax.tree_util.tree_leaves_with_path(ref.params)
    for (path, r), g, i in zip(flat_ref, jax.tree.leaves(got.params), jax.tree.leaves(init.params)):
        scale = float(np.abs(r - i).max())
        assert scale > 1e-4, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-3 * scale + 1e-7, err_msg=jax.tree_util.keystr(path))
    # the same checkpoint layout, each stage holding 1/stages of the blocks
    assert jax.tree.map(np.shape, got.params) == jax.tree.map(np.shape, ref.params)
    assert blocks_bytes * CASES[case][0]["stage"] <= ref_bytes


def test_bubble_fraction_by_hand():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2) == pytest.approx(1 / 3)  # 2 micro-batches: 3 iterations, 1 idle per stage
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 16, repeats=4) < bubble_fraction(4, 16)


def test_stage_layers_gpipe_and_circular():
    assert stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage_layers(8, 2, repeats=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert stage_layers(8, 4, repeats=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def spec_of(**keys) -> ModelSpec:
    m = pipeline_config().model
    m.update(keys)
    return ModelSpec.from_config(m)


def test_runtime_checks_name_the_keys():
    check(spec_of(), 2, 16, 2)
    with pytest.raises(UserError, match=r"model.n_layers=8 must split into mesh.stage=3"):
        check(spec_of(), 3, 18)
    with pytest.raises(UserError, match=r"model.pipeline_repeats=2.*equal chunks"):
        check(spec_of(n_layers=4, pipeline_repeats=2), 4, 16)
    with pytest.raises(UserError, match=r"16 rows in model.pipeline_microbatches=3"):
        check(spec_of(pipeline_microbatches=3), 2, 16)
    with pytest.raises(UserError, match=r"divisible by the 4 batch shards"):
        check(spec_of(pipeline_microbatches=8), 2, 16, 4)
    with pytest.raises(UserError, match=r"circular.*at least mesh.stage=4"):
        check(spec_of(pipeline_repeats=2, pipeline_microbatches=2), 4, 16)
    with pytest.raises(UserError, match=r"mixture-of-experts.*cannot be pipelined"):
        check(spec_of(n_experts=4), 2, 16)


def test_config_checks_name_the_keys():
    with pytest.raises(
        UserError, match=r"'model.n_layers' = 8: must split into mesh.stage=2 x model.pipeline_repeats=3"
    ):
        pipeline_config(dict(stage=2), pipeline_repeats=3)
    with pytest.raises(UserError, match=r"'model.pipeline_microbatches' = 2: a circular"):
        pipeline_config(dict(stage=4), pipeline_repeats=2, pipeline_microbatches=2)
    with pytest.raises(UserError, match=r"'model.n_experts' = 4: mixture-of-experts"):
        pipeline_config(dict(stage=2), n_experts=4)
    with pytest.raises(UserError, match=r"'model.pipeline_microbatches' = 6: interleaved 1F1B .* multiple"):
        pipeline_config(dict(stage=4), pipeline_repeats=2, pipeline_microbatches=6, pipeline_schedule="1f1b")
    pipeline_config(dict(stage=4), pipeline_repeats=2)  # 8 layers, 4 micro-batches: fine


@needs_8_devices
def test_the_batch_is_checked_when_it_runs():
    c = pipeline_config(dict(stage=2, data=4))
    mesh = make_mesh(c.mesh)
    model = Transformer(ModelSpec.from_config(c.model), Partitioning(mesh, rules_table(c)))
    params = nn.unbox(jax.eval_shape(lambda k: init_params(model, k), jax.random.key(0)))
    ids = jnp.zeros((4, 8), jnp.int32)  # 2 micro-batches of 2 rows over 4 batch shards
    with pytest.raises(UserError, match=r"divisible by the 4 batch shards"):
        jax.eval_shape(lambda p: model.apply({"params": p}, ids, ids + 1, ids), params)


@needs_8_devices
def test_decoding_is_never_pipelined():
    mesh = make_mesh(dict(stage=2, data=4))
    part = Partitioning(mesh, rules_table(pipeline_config()))
    assert is_pipelined(part, decode=False)
    assert not is_pipelined(part, decode=True)
    assert not is_pipelined(Partitioning(make_mesh(dict(data=8)), part.rules), decode=False)


@needs_8_devices
def test_decoding_on_a_stage_mesh_runs_the_plain_scan():
    """3 rows: no pipeline takes them (2 micro-batches), a prefill does."""
    c = pipeline_config(dict(stage=2, fsdp=2, tensor=2))
    built = build_model(c, jax.devices(), rules=rules_table(c))
    params = built.abstract_params()
    ids = jnp.zeros((3, 8), jnp.int32)
    with pytest.raises(UserError, match="a batch of 3 rows"):
        jax.eval_shape(lambda p: built.module.apply({"params": p}, ids, ids + 1, ids), params)
    cache = jax.eval_shape(lambda: init_cache(built.module, 3, 8))
    logits, _ = jax.eval_shape(lambda p, k: decode_step(built.module, p, k, ids, ids + 1, ids), params, cache)
    assert logits.shape == (3, 8, c.model.vocab_size)


def loss_and_grads(case, z_loss=0.0):
    """(loss terms, gradients) of the pretraining loss for one batch, on the case's mesh."""
    mesh, model_kw, _ = CASES.get(case, ({}, {}, 1))
    c = pipeline_config(mesh, 1, **model_kw)
    r = build_run(c, devices=jax.devices()[: math.prod(c.mesh[a] for a in AXES)])
    params = jax.device_put(two_steps("reference")[0].params, r.state_shardings.params)
    loss = pretrain_loss(r.model, z_loss)
    batch = put(r, packed_batch())
    value = jax.jit(lambda p: loss(p, batch, {}, None))(params)
    grads = jax.jit(jax.grad(lambda p: loss(p, batch, {}, None)[0]))(params)
    return jax.device_get(value), jax.device_get(grads)


def assert_same_grads(ref, got, zero: tuple = ()):
    """Every gradient leaf equals the reference's within 1e-4 of its largest value, and none is
    all zero, but the leaves whose path starts with one of `zero`, which must be."""
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        name, scale = jax.tree_util.keystr(path), float(np.abs(r).max())
        if zero and name.startswith(zero):
            assert scale == 0, name
            continue
        assert scale > 0, name
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-4 * scale, err_msg=name)


@needs_8_devices
@pytest.mark.parametrize("case", ["1f1b-4stages", "interleaved-2stages"])
def test_1f1b_gradients_equal_one_device_leaf_by_leaf(case):
    """The loss and its gradients come out of the 1F1B loop itself (a custom VJP): every leaf,
    the embedding (reached through the first stage's inputs' gradients) and the head included."""
    (ref_obj, ref_sums), ref = loss_and_grads("reference", z_loss=1e-3)
    (obj, sums), got = loss_and_grads(case, z_loss=1e-3)
    np.testing.assert_allclose(obj, ref_obj, rtol=1e-5)
    for k in ref_sums:
        np.testing.assert_allclose(sums[k], ref_sums[k], rtol=1e-5, err_msg=k)
    assert_same_grads(ref, got)


@needs_8_devices
def test_1f1b_refuses_a_loss_that_differentiates_the_plain_forward():
    """Only the losses that run inside the pipeline train under 1F1B; another loss (a reward model, a
    distillation) differentiating the model's logits gets one clear line, not GPipe's memory."""
    mesh, model_kw, _ = CASES["1f1b-2stages"]
    c = pipeline_config(mesh, 1, **model_kw)
    r = build_run(c, devices=jax.devices()[:8])
    params = r.abstract_state().params
    batch = put(r, packed_batch())
    logits = lambda p: r.model.apply({"params": p}, batch["inputs"], batch["segment_ids"], batch["positions"])  # noqa: E731
    assert jax.eval_shape(logits, params).shape[:2] == batch["inputs"].shape  # evaluating is fine
    with pytest.raises(UserError, match=r"model.pipeline_schedule=1f1b .*set model.pipeline_schedule=gpipe"):
        jax.eval_shape(jax.grad(lambda p: jnp.sum(logits(p))), params)
