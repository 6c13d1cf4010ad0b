"""Blockwise attention (custom backward pass) against the plain reference: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model.attention import reference_attention, segment_causal_mask
from lm.model.blockwise import blockwise_attention, keeps_probs, query_blocks


def inputs(b, t, n, k, h, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), dtype) for heads in (n, k, k))
    cot = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)  # a non-uniform cotangent
    return q, kk, v, cot


def packed_segments(b, t):
    """Row 0: three documents then padding (segment 0); the other rows: one document each."""
    seg = np.ones((b, t), np.int32)
    seg[0, t // 3 : 2 * t // 3], seg[0, 2 * t // 3 :], seg[0, t - 3 :] = 2, 3, 0
    return jnp.asarray(seg)


def value_and_grads(attention, q, k, v, cot):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cot)
    return attention(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_query_blocks_cover_the_sequence():
    assert query_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert query_blocks(8, 8) == [(0, 8)]
    assert query_blocks(3, 8) == [(0, 3)]


# (b, t, n_heads, n_kv_heads, head_dim, query block): GQA groups of 1, 2 and 4 (MQA), one block,
# a block that does not divide the length, single-position blocks.
SHAPES = [(2, 16, 4, 4, 8, 4), (2, 24, 4, 2, 16, 8), (1, 20, 4, 1, 8, 6), (2, 12, 2, 1, 4, 32), (1, 7, 2, 2, 4, 1)]


def test_probabilities_are_kept_only_for_short_sequences():
    # T=256, 6 heads of 64, blocks of 64: 6*64*(64+128+192+256) = 245,760 probabilities
    # against (6+6+6+6)*256*64 = 393,216 elements of q, k, v and output.
    assert keeps_probs(256, 6, 6, 64, 64)
    # T=2048: 6*64*64*(1+...+32) = 13.0M against 24*2048*64 = 3.1M.
    assert not keeps_probs(2048, 6, 6, 64, 64)
    # Fewer kv-heads shrink k and v: 4*8*(8+16+24+32) = 2,560 probabilities against
    # (8+8)*32*6 = 3,072 with 4 kv-heads, but (8+2)*32*6 = 1,920 with one.
    assert keeps_probs(32, 4, 4, 6, 8) and not keeps_probs(32, 4, 1, 6, 8)


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("b, t, n, k, h, block", SHAPES)
def test_blockwise_matches_reference_with_segments_and_gqa(b, t, n, k, h, block, keep_probs):
    q, kk, v, cot = inputs(b, t, n, k, h)
    seg = packed_segments(b, t)
    mask = segment_causal_mask(seg)
    attention = lambda q, k, v: blockwise_attention(q, k, v, seg, block, keep_probs)
    out, grads = jax.jit(lambda *a: value_and_grads(attention, *a))(q, kk, v, cot)
    ref_out, ref_grads = value_and_grads(lambda q, k, v: reference_attention(q, k, v, mask), q, kk, v, cot)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert float(jnp.abs(r).max()) > 1e-2, name  # the gradient is not trivially zero
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_packed_documents_get_no_gradient_from_each_other():
    """The loss of document 2 alone has zero gradient w.r.t. every key and value of document 1."""
    b, t = 1, 12
    q, k, v, cot = inputs(b, t, 4, 2, 8, seed=5)
    seg = jnp.asarray([[1] * 5 + [2] * 7], jnp.int32)
    doc2 = (jnp.arange(t) >= 5)[None, :, None, None]
    loss = lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, seg, 4) * cot * doc2)
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert float(jnp.abs(g[:, :5]).max()) == 0.0
        assert float(jnp.abs(g[:, 5:]).max()) > 1e-3


@pytest.mark.parametrize("keep_probs", [False, True])
def test_bfloat16_close_to_float32(keep_probs):
    q, k, v, cot = inputs(2, 32, 4, 2, 16, seed=6)
    seg = packed_segments(2, 32)
    attention = lambda q, k, v: blockwise_attention(q, k, v, seg, 8, keep_probs)
    run = jax.jit(lambda *a: value_and_grads(attention, *a))
    out, grads = run(q, k, v, cot)
    out16, grads16 = run(*(a.astype(jnp.bfloat16) for a in (q, k, v)), cot)
    assert out16.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads16)
    np.testing.assert_allclose(out16.astype(jnp.float32), out, atol=5e-2)
    for g16, g in zip(grads16, grads):
        scale = float(jnp.abs(g).max())
        assert float(jnp.abs(g16.astype(jnp.float32) - g).max()) < 0.05 * scale
