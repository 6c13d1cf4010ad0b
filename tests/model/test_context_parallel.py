"""Context parallelism (the sequence split over the `context` mesh axis) on 8 simulated CPU devices:
the loss and every gradient of a small model, and one train step, equal the single-device run for
both attention strategies (model.context_attention), with packed documents crossing the shards'
boundaries, grouped kv heads, a sliding-window layer, and fsdp, tensor and data beside `context`."""

import functools
import math

import flax.linen as nn
import jax
import numpy as np
import pytest

from lm.config import base_config, rules_table, validate
from lm.config.mesh import AXES
from lm.errors import UserError
from lm.model import ring_attention
from lm.model.apply import logits_of
from lm.model.build import build_model
from lm.model.transformer import init_params as init
from lm.train.losses import masked_cross_entropy
from lm.train.setup import build_run

B, T, V = 4, 32, 96
MESHES = {"context4-fsdp2": dict(context=4, fsdp=2), "context2-tensor2-data2": dict(context=2, tensor=2, data=2)}
STRATEGIES = ("allgather", "ring")


def config(mesh=None, strategy="allgather"):
    c = base_config()
    # kv heads 2 of 4 query heads (grouped); one local layer with a window shorter than a shard
    c.model.update(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T,
        layer_types=("local", "global"), sliding_window=6, context_attention=strategy,
    )  # fmt: skip
    c.optim.update(lr=1e-3, warmup_steps=0, eps=1e-6)
    c.train.update(batch_size=B, micro_batches=1, steps=10)
    c.data.seq_len = T
    c.mesh.update(dict(data=1) | (mesh or {}))
    validate(c)
    return c


def packed_batch():
    """Documents ending inside shards (3, 11, 13, 21, 27) and on their boundaries (8, 16): shards
    hold 8 or 16 tokens, ring chunks 4 or 8. One row padded at its end, some targets masked."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    cuts = [(11, 21), (3, 13), (27, T), (8, 16)]
    seg = np.stack([np.searchsorted(np.asarray(c), np.arange(T), side="right") + 1 for c in cuts]).astype(np.int32)
    seg[2, 27:] = 0  # padding
    starts = np.stack([np.maximum.accumulate(np.where(np.diff(s, prepend=-1) != 0, np.arange(T), 0)) for s in seg])
    pos = (np.arange(T)[None] - starts).astype(np.int32)
    mask = (seg != 0).astype(np.float32)
    mask[1, :5] = 0.0
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask, segment_ids=seg, positions=pos)


def devices_of(c):
    return jax.devices()[: math.prod(c.mesh[a] for a in AXES)]


@functools.cache
def init_params():
    """The single-device model's initial params on the host."""
    c = config()
    module = build_model(c, devices_of(c), rules=rules_table(c)).module
    return jax.device_get(jax.jit(lambda r: nn.unbox(init(module, r, T)))(jax.random.PRNGKey(0)))


@functools.cache
def loss_and_grads(mesh_name=None, strategy="allgather"):
    """Host (loss, grads) of the packed batch's summed cross-entropy on a mesh (None: one
    device), from the same initial params."""
    c = config(MESHES.get(mesh_name), strategy)
    built = build_model(c, devices_of(c), rules=rules_table(c))
    batch = packed_batch()
    batch = jax.device_put(batch, built.batch_shardings(batch))

    def loss(params):
        nll, _, _ = masked_cross_entropy(logits_of(built.module, params, batch), batch["targets"], batch["loss_mask"])
        return nll

    return jax.device_get(jax.jit(jax.value_and_grad(loss))(built.place(init_params())))


def assert_trees_close(got, ref, rtol=2e-5):
    """Every leaf equal within float tolerance scaled to the leaf's magnitude."""
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        scale = float(np.abs(r).max())
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_loss_and_every_gradient_equal_single_device(mesh, strategy, monkeypatch):
    calls = []
    real = ring_attention.context_attention
    monkeypatch.setattr(ring_attention, "context_attention", lambda s, *a, **k: calls.append(s) or real(s, *a, **k))
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(mesh, strategy), loss_and_grads()
    assert calls and set(calls) == {strategy}  # the split attention ran (not the unsplit fallback)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


@functools.cache
def initial_state():
    """The single-device run's initial train state on the host."""
    c = config()
    return jax.device_get(build_run(c, devices=devices_of(c)).init_state(0))


@functools.cache
def train_step(mesh_name=None, strategy="allgather"):
    """Host (metrics, params) after one train step from the single-device initial state."""
    c = config(MESHES.get(mesh_name), strategy)
    r = build_run(c, devices=devices_of(c))
    state = jax.device_put(initial_state(), r.state_shardings)
    state, metrics = r.train_step()(state, r.placer(r.signature())(packed_batch()))
    return jax.device_get(metrics), jax.device_get(state.params)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_train_step_matches_single_device(strategy):
    ref_metrics, ref_params = train_step()
    metrics, params = train_step("context4-fsdp2", strategy)
    for k in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, err_msg=k)
    assert float(metrics["tokens"]) == float(ref_metrics["tokens"]) == packed_batch()["loss_mask"].sum()
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    init = initial_state().params
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(init))) > 5e-4


def test_state_created_and_batch_split_on_a_context_mesh():
    c = config(MESHES["context4-fsdp2"], "ring")
    r = build_run(c, devices=devices_of(c))
    assert_trees_close(jax.device_get(r.init_state(0).params), initial_state().params, rtol=1e-6)
    batch = r.placer(r.signature())(packed_batch())
    assert tuple(batch["inputs"].sharding.spec) == (("data", "fsdp", "expert"), "context")
    assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(B // 2, T // 4)}
    np.testing.assert_array_equal(batch["segment_ids"], packed_batch()["segment_ids"])


def test_seq_len_must_split_over_context():
    with pytest.raises(UserError, match=r"mesh.context.*data.seq_len=32 must split into 3"):
        config(dict(context=3))
    with pytest.raises(UserError, match=r"mesh.context.*data.seq_len=32 must split into 64 .*ring"):
        config(dict(context=32), "ring")
    config(dict(context=16))  # allgather: 16 chunks of 2
