"""Grouped-query attention with RoPE and a packed-document (segment) causal mask."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model.blockwise import blockwise_attention
from lm.model.layers import ModelSpec, Partitioning, matmul, matmuls, normal, param


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each [B, T, 1, 2, H/2] float32, for `apply_rope`; sin carries the rotation's sign.

    Computed once per forward pass: a fused consumer would otherwise recompute the sines
    and cosines for every head of every layer.
    """
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.stack([cos, cos], axis=-2)[:, :, None], jnp.stack([-sin, sin], axis=-2)[:, :, None]


def apply_rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates channel pairs (i, i + H/2) of x [B, T, N, H] by the angles in `tables`.

    The halves are swapped by reversing a size-2 axis rather than by split and concatenate,
    so forward and backward each stay one elementwise pass.
    """
    cos, sin = tables
    b, t, n, h = x.shape
    xf = x.astype(jnp.float32).reshape(b, t, n, 2, h // 2)
    return (xf * cos + xf[..., ::-1, :] * sin).reshape(x.shape).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """RoPE of x [B, T, N, H] at integer positions [B, T]."""
    return apply_rope(x, rope_tables(positions, x.shape[-1], theta))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, T] bool: query t sees key s iff s <= t and both are in the same document."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None]


def reference_attention(q, k, v, mask) -> jax.Array:
    """Plain softmax attention, float32 softmax. q: [B,T,N,H], k/v: [B,S,K,H], mask [B,1,T,S]."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def attend(q, k, v, segment_ids, implementation: str) -> jax.Array:
    """Causal attention within documents. q: [B,T,N,H], k/v: [B,T,K,H], segment_ids: [B,T]."""
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids)
    mask = segment_causal_mask(segment_ids)
    if implementation == "reference":
        return reference_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


class Attention(nn.Module):
    spec: ModelSpec
    part: Partitioning

    @nn.compact
    def __call__(self, x, segment_ids, rope_cs):
        """rope_cs: `rope_tables` of the positions, or None without RoPE."""
        s, dt, c = self.spec, self.spec.dtype, self.part.constrain
        init, out_init = normal(s.init_std), normal(s.init_std / (2 * s.n_layers) ** 0.5)

        heads = {"wq": (s.n_heads, "q_heads"), "wk": (s.n_kv_heads, "kv_heads"), "wv": (s.n_kv_heads, "kv_heads")}
        ws = [param(self, name, init, (s.d_model, n, s.head_dim), ("embed", axis, "head_dim"))
              for name, (n, axis) in heads.items()]
        qkv = matmuls(x, ["btd,dnh->btnh"] * 3, ws)  # x is kept once for the three backward products
        if s.use_bias:
            qkv = [y + param(self, name + "_bias", nn.initializers.zeros, (n, s.head_dim), (axis, "head_dim")).astype(dt)
                   for y, (name, (n, axis)) in zip(qkv, heads.items())]
        q = c(qkv[0], ("batch", "length", "act_heads", None))
        k, v = (c(y, ("batch", "length", "act_kv_heads", None)) for y in qkv[1:])
        if rope_cs is not None:
            q, k = apply_rope(q, rope_cs), apply_rope(k, rope_cs)
        y = attend(q, k, v, segment_ids, s.attention)
        y = c(y, ("batch", "length", "act_heads", None))
        wo = param(self, "wo", out_init, (s.n_heads, s.head_dim, s.d_model), ("q_heads", "head_dim", "embed"))
        out = matmul("btnh,nhd->btd", y, wo)
        if s.use_bias:
            out = out + param(self, "wo_bias", nn.initializers.zeros, (s.d_model,), ("embed",)).astype(dt)
        return c(out, ("batch", "length", "act_embed"))
