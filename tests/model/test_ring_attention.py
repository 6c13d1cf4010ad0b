"""Attention with the sequence split over `context` (lm.model.ring_attention) equals the unsplit
reference attention, outputs and gradients, on random inputs with random packed documents, on 8
simulated CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config, rules_table
from lm.model import ring_flash
from lm.model.attention import attend, reference_attention, segment_causal_mask
from lm.model.layers import Partitioning
from lm.model.ring_attention import _balance, _unbalance, context_shards, takes
from lm.model.ring_flash import chunk_indices
from lm.sharding import make_mesh

B, T, N, K, H = 2, 32, 4, 2, 8
MESHES = {"context4-fsdp2": dict(context=4, fsdp=2), "context2-tensor2-data2": dict(context=2, tensor=2, data=2)}


def part_of(mesh: dict) -> Partitioning:
    c = base_config()
    c.mesh.update(dict(data=1) | mesh)
    n = int(np.prod(list(mesh.values())))
    return Partitioning(make_mesh(c.mesh, jax.devices()[:n]), rules_table(c))


def inputs(seed=0, kv=K):
    """Random q, k, v and rows of random documents (boundaries anywhere, padding 0 at the end)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, kv, H)).astype(np.float32) for _ in range(2))
    seg = np.cumsum(rng.random((B, T)) < 0.15, axis=1).astype(np.int32) + 1
    seg[1, -5:] = 0  # padding
    return q, k, v, seg


def want(q, k, v, seg, window=None, scale=0.0, cap=0.0):
    return reference_attention(q, k, v, segment_causal_mask(jnp.asarray(seg), window), scale, cap)


@functools.cache
def split_fn(mesh_name: str, strategy: str, window, scale, cap):
    part = part_of(MESHES[mesh_name])
    fn = lambda q, k, v, s: attend(  # noqa: E731
        q, k, v, s, "xla", None if window is None else jnp.int32(window), scale, cap, part, context=strategy
    )
    return part, jax.jit(fn)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("variant", ["plain", "window", "scale-cap", "mha"])
def test_split_attention_equals_reference(strategy, mesh, variant):
    window, scale, cap = {"window": (5, 0.0, 0.0), "scale-cap": (None, 0.3, 2.0)}.get(variant, (None, 0.0, 0.0))
    q, k, v, seg = inputs(kv=N if variant == "mha" else K)
    part, fn = split_fn(mesh, strategy, window, scale, cap)
    assert context_shards(part) == MESHES[mesh]["context"] and takes(part, strategy, q, k)
    np.testing.assert_allclose(fn(q, k, v, seg), want(q, k, v, seg, window, scale, cap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "strategy,query_block,cap",
    [("allgather", 0, 0.0), ("ring", 0, 0.0), ("ring", 2, 0.0), ("ring", 2, 1.5)],
    ids=["allgather", "ring", "ring-query-blocks", "ring-query-blocks-softcap"],
)
def test_split_attention_gradients_equal_reference(strategy, query_block, cap, monkeypatch):
    """The ring's hand-written backward (lm.model.ring_flash), also with its queries in blocks
    of 2 (4 blocks per device at step 0, 2 on the later steps' visible halves) and a soft cap."""
    if query_block:
        monkeypatch.setattr(ring_flash, "QUERY_BLOCK", query_block)
    q, k, v, seg = inputs(1)
    w = np.random.default_rng(2).normal(size=(B, T, N, H)).astype(np.float32)
    fn = split_fn.__wrapped__("context4-fsdp2", strategy, 6, 0.0, cap)[1]
    got = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, seg) * w), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(want(*a, seg, 6, 0.0, cap) * w), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(np.abs(r).max()), err_msg=name)


def test_balanced_layout_round_trips_and_balances_causal_work():
    part = part_of(dict(context=4, fsdp=2))
    x = jnp.arange(B * T).reshape(B, T)

    def per_device(x):
        me = jax.lax.axis_index("context")
        balanced = _balance(x, ("context",), 4, me)
        return balanced, _unbalance(balanced, ("context",), 4, me), chunk_indices(me, 4, x.shape[1] // 2)[None]

    from jax.sharding import PartitionSpec as P

    spec = P(None, "context")
    balanced, back, idx = jax.jit(
        jax.shard_map(per_device, mesh=part.mesh, in_specs=spec, out_specs=(spec, spec, spec), check_vma=False)
    )(x)
    np.testing.assert_array_equal(back, x)
    # device i holds chunks i and 7-i of 8 (4 tokens each), and knows their global indices
    chunks = [0, 7, 1, 6, 2, 5, 3, 4]
    np.testing.assert_array_equal(balanced[0], np.concatenate([np.arange(c * 4, c * 4 + 4) for c in chunks]))
    np.testing.assert_array_equal(idx[0], balanced[0])
    # every device's tokens see the same number of (causal) keys
    seen = np.asarray(idx[0]).reshape(4, 8) + 1
    assert len(set(seen.sum(axis=1))) == 1


def test_uneven_split_falls_back_to_the_unsplit_path():
    part = part_of(dict(context=4, fsdp=2))
    q, k, v, seg = inputs()
    q1, k1, v1 = q[:1], k[:1], v[:1]  # one row cannot split over fsdp=2
    assert not takes(part, "ring", q1, k1)
    got = jax.jit(lambda *a: attend(*a, "auto", part=part, context="ring"))(q1, k1, v1, seg[:1])
    np.testing.assert_allclose(got, want(q1, k1, v1, seg[:1]), rtol=1e-5, atol=1e-5)
