"""RoPE, the segment causal mask and attention against independent numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from lm.model.attention import attend, reference_attention, segment_causal_mask
from lm.model.rope import rope


def np_rope(x, positions, theta):
    """Rotates each pair (i, i + H/2) by angle pos * theta^(-i / (H/2)). x: [B, T, N, H]."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for i in range(half):
                a = positions[b, t] * theta ** (-i / half)
                x1, x2 = x[b, t, :, i], x[b, t, :, i + half]
                out[b, t, :, i] = x1 * np.cos(a) - x2 * np.sin(a)
                out[b, t, :, i + half] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


def np_attention(q, k, v, mask):
    """Softmax attention; query head n reads kv head n // (N / K). mask: [B, 1, T, S] bool."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for ni in range(n):
            kv = ni // groups
            s = q[bi, :, ni] @ k[bi, :, kv].T / np.sqrt(h)
            s = np.where(mask[bi, 0], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[bi, :, ni] = p @ v[bi, :, kv]
    return out


# ---- rope -------------------------------------------------------------------------------


def test_rope_tables_are_computed_once_and_match_rope():
    from lm.model.rope import apply_rope, rope_tables

    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 0, 1, 100, 2]], np.int32)
    tables = rope_tables(jnp.asarray(pos), 8, 10000.0)
    assert [t.shape for t in tables] == [(2, 5, 1, 2, 4)] * 2
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), tables)), np_rope(x, pos, 10000.0), atol=1e-5)


def test_rope_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 0, 1, 100, 2]], np.int32)
    got = rope(jnp.asarray(x), jnp.asarray(pos), 10000.0)
    np.testing.assert_allclose(np.asarray(got), np_rope(x, pos, 10000.0), atol=1e-5)
    got = rope(jnp.asarray(x), jnp.asarray(pos), 500000.0)
    np.testing.assert_allclose(np.asarray(got), np_rope(x, pos, 500000.0), atol=1e-5)


def test_rope_preserves_norm_and_position_zero_is_identity():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 6, 2, 16)).astype(np.float32)
    pos = np.array([[0, 3, 17, 250, 1000, 4095]], np.int32)
    y = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 10000.0))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=0, atol=4e-7 * np.abs(x).max())  # cos 0, sin 0: a few ulp
    assert not np.allclose(y[:, 1], x[:, 1])  # a nonzero position really rotates


def test_rope_dot_product_depends_only_on_relative_position():
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))

    def score(m, n):
        rq = rope(q, jnp.array([[m]]), 10000.0)
        rk = rope(k, jnp.array([[n]]), 10000.0)
        return float(jnp.sum(rq * rk))

    offset3 = [score(m, m - 3) for m in (3, 5, 10, 40)]
    np.testing.assert_allclose(offset3, offset3[0], rtol=1e-4, atol=1e-5)
    offset0 = [score(m, m) for m in (0, 7, 33)]
    np.testing.assert_allclose(offset0, float(jnp.sum(q * k)), rtol=1e-4, atol=1e-5)
    assert abs(offset3[0] - offset0[0]) > 1e-3  # the offset does matter


# ---- mask -------------------------------------------------------------------------------


def test_segment_causal_mask_exact():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]], jnp.int32)
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        bool,
    )
    mask = np.asarray(segment_causal_mask(seg))
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == bool
    np.testing.assert_array_equal(mask[0, 0], expected)


def test_segment_causal_mask_per_row():
    seg = jnp.array([[1, 1, 1], [1, 2, 3]], jnp.int32)
    mask = np.asarray(segment_causal_mask(seg))[:, 0]
    np.testing.assert_array_equal(mask[0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(mask[1], np.eye(3, dtype=bool))


# ---- attention ----------------------------------------------------------------------------

SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(3)
    b, t, n, k, h = 2, 8, 4, 2, 16
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    kk = rng.normal(size=(b, t, k, h)).astype(np.float32)
    v = rng.normal(size=(b, t, k, h)).astype(np.float32)
    return q, kk, v, np.asarray(segment_causal_mask(jnp.asarray(SEGMENTS)))


def test_reference_attention_matches_numpy_gqa(qkv):
    q, k, v, mask = qkv
    got = reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np_attention(q, k, v, mask), atol=1e-5)


def test_reference_attention_uses_the_mask(qkv):
    q, k, v, mask = qkv
    full = np.ones_like(mask)
    got = np.asarray(reference_attention(*(jnp.asarray(a) for a in (q, k, v, full))))
    np.testing.assert_allclose(got, np_attention(q, k, v, full), atol=1e-5)
    assert not np.allclose(got, np_attention(q, k, v, mask), atol=1e-3)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_attend_equals_numpy(qkv, implementation):
    q, k, v, mask = qkv
    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(SEGMENTS), implementation)
    np.testing.assert_allclose(np.asarray(got), np_attention(q, k, v, mask), atol=1e-5)
