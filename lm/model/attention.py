"""Grouped-query attention with RoPE and a packed-document (segment) causal mask.

Two modes over the same params. Training: queries and keys are the same tokens. Decoding
(prefill and decode steps): the new tokens' keys and values are written into a preallocated
cache (the "cache" collection: [batch, kv_heads, max_len, head_dim], only kv heads) at slot =
position, per row, and the queries attend to the whole cache under a mask built by the
decoder from positions and segment ids (`lm.model.cache`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model import fused_attention as fused
from lm.model import paged_kernel, ring_attention
from lm.model.blockwise import blockwise_attention
from lm.model.layers import Norm, Partitioning, fp8_history, matmul, matmuls, normal
from lm.model.lora import lora_delta, targeted
from lm.model.paged import KV_DTYPES, POOL_AXES, SCALE_AXES, Paging, quantize_kv, read_pool, write_pool
from lm.model.params import param
from lm.model.pipeline import stages_of
from lm.model.rope import apply_rope
from lm.model.spec import ModelSpec

MASKED = float(jnp.finfo(jnp.float32).min)
CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")


def segment_causal_mask(segment_ids: jax.Array, window=None) -> jax.Array:
    """[B, 1, T, T] bool: query t sees key s iff s <= t and both are in the same document (and,
    with a window, t - s < window: a sliding-window layer)."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    if window is not None:
        causal = causal & (jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None]


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): logits bounded smoothly (0: unchanged)."""
    return x if not cap else jnp.tanh(x / cap) * cap


def reference_attention(q, k, v, mask, scale: float = 0.0, cap: float = 0.0) -> jax.Array:
    """Plain softmax attention, float32 softmax. q: [B,T,N,H], k/v: [B,S,K,H], mask [B,1,T,S].
    scale: logits' factor (0: 1/sqrt(H)); cap: their soft cap (0: none)."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    if scale:
        logits = softcap(logits * scale, cap)
    else:
        logits = softcap(logits / jnp.sqrt(q.shape[-1]).astype(jnp.float32), cap)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def attend(
    q,
    k,
    v,
    segment_ids,
    implementation: str,
    window=None,
    scale: float = 0.0,
    cap: float = 0.0,
    part: Partitioning = Partitioning(),
    local=None,
    sliding_window: int = 0,
    context: str = "allgather",
) -> jax.Array:
    """Causal attention within documents. q: [B,T,N,H], k/v: [B,T,K,H], segment_ids: [B,T].
    window (a traced per-layer value is fine), scale and cap as `reference_attention`; blockwise
    has none of them and hands such a layer to the reference path. implementation "auto" is the
    backend's fused kernel (lm.model.fused_attention); a fused kernel gets a model's local layers
    as `local` (this layer's traced flag) and `sliding_window`, and runs on `part`'s mesh.
    With the sequence split over the mesh (`context`: "allgather" or "ring", see
    lm.model.ring_attention) no fused kernel runs: the split attention, else the XLA path."""
    implementation = fused.resolve(implementation, part)
    if ring_attention.context_shards(part) > 1:
        if ring_attention.takes(part, context, q, k):
            return ring_attention.context_attention(context, q, k, v, segment_ids, part, window, scale, cap)
        implementation = "blockwise" if implementation in ("splash", "flash") else implementation
    if implementation in ("splash", "flash"):
        t = q.shape[1]
        window_of = lambda on: sliding_window if on and sliding_window < t else None  # noqa: E731
        takes = all(fused.takes(implementation, t, window_of(on), cap) for on in (False, local is not None))
        if takes and stages_of(part) == 1:  # a pipeline's stage runs under vmap: no shard_map there
            run = lambda on: fused.fused_attention(  # noqa: E731
                implementation, q, k, v, segment_ids, part, scale, cap, window_of(on)
            )
            if local is None or window_of(True) is None:
                return run(False)
            return jax.lax.cond(local, lambda: run(True), lambda: run(False))
        implementation = "blockwise"  # a length, a layer or a pipeline the kernel does not take
    plain = window is None and not scale and not cap
    if implementation == "blockwise" and plain:
        return blockwise_attention(q, k, v, segment_ids)
    mask = segment_causal_mask(segment_ids, window)
    if implementation in ("reference", "blockwise") or cap:
        return reference_attention(q, k, v, mask, scale, cap)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale or None, implementation=implementation)


def cached_attention(q, k_cache, v_cache, mask, scale: float = 0.0, cap: float = 0.0) -> jax.Array:
    """q [B,t,N,H] against the whole cache [B,K,S,H]; mask [B,t,S] bool -> [B,t,N,H].

    Batch and kv-head axes are folded into one batch axis, and a kv head's query heads and
    query positions into the rows of one product: the cache is read in its own layout (no step
    copies it), and XLA:CPU runs a dot with a single batch axis several times faster than the
    same einsum with two.
    """
    b, t, n, h = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = n // kv
    qg = (
        (q * jnp.asarray(scale or h**-0.5, q.dtype))
        .reshape(b, t, kv, g, h)
        .transpose(0, 2, 1, 3, 4)
        .reshape(b * kv, t * g, h)
    )
    batched = ((0,), (0,))
    logits = jax.lax.dot_general(
        qg, k_cache.reshape(b * kv, s, h), (((2,), (2,)), batched), preferred_element_type=jnp.float32
    ).reshape(b, kv, t, g, s)
    logits = (
        jnp.where(mask[:, None, :, None, :], softcap(logits, cap), MASKED)
        if cap
        else jnp.where(mask[:, None, :, None, :], logits, MASKED)
    )
    probs = jax.nn.softmax(logits, axis=-1).astype(v_cache.dtype).reshape(b * kv, t * g, s)
    out = jax.lax.dot_general(
        probs, v_cache.reshape(b * kv, s, h), (((2,), (1,)), batched), preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype).reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def paged_attention(q, keys, values, mask, scale: float = 0.0, cap: float = 0.0) -> jax.Array:
    """q [B,t,N,H] against keys and values gathered from the page pool [K,B,S,H]; mask [B,t,S] bool
    -> [B,t,N,H]. The products of `cached_attention`, with the kv-head axis outermost."""
    b, t, n, h = q.shape
    kv, s = keys.shape[0], keys.shape[2]
    g = n // kv
    qg = (q * jnp.asarray(scale or h**-0.5, q.dtype)).reshape(b, t, kv, g, h).transpose(2, 0, 1, 3, 4)
    batched = ((0,), (0,))
    logits = jax.lax.dot_general(
        qg.reshape(kv * b, t * g, h),
        keys.reshape(kv * b, s, h),
        (((2,), (2,)), batched),
        preferred_element_type=jnp.float32,
    ).reshape(kv, b, t, g, s)
    logits = jnp.where(mask[None, :, :, None, :], softcap(logits, cap), MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(values.dtype).reshape(kv * b, t * g, s)
    out = jax.lax.dot_general(
        probs, values.reshape(kv * b, s, h), (((2,), (1,)), batched), preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype).reshape(kv, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b, t, n, h)


def write_cache(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [B,K,S,H] with new [B,t,K,H] written at slots [B,t]; slots >= S are dropped."""
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, slots].set(new.astype(cache.dtype), mode="drop")


class Attention(nn.Module):
    spec: ModelSpec
    part: Partitioning
    decode: bool = False
    paging: Paging | None = None  # decode against a paged pool (lm.model.paged) instead of a dense cache

    @nn.compact
    def __call__(self, x, segment_ids, rope_cs, cache_slots=None, cache_mask=None, local=None):
        """rope_cs: `rope_tables` of the positions, or None without RoPE. In decode mode,
        cache_slots [B,t] (where each token's key goes; >= max_len: nowhere) and cache_mask
        [B,t,S] (which slots each query sees) come from the decoder; with paging, cache_slots
        is the pair (pool rows to write [B,t], pool rows to read [B,S]). A model with local
        (sliding-window) layers gets `local` (this layer's flag, traced) and pairs (global,
        local) of rope_cs and cache_mask."""
        s, dt, c = self.spec, self.spec.dtype, self.part.constrain
        a = s.attention
        init, out_init = normal(s.init_std), normal(s.init_std / (2 * s.n_layers) ** 0.5)

        heads = {"wq": (a.n_heads, "q_heads"), "wk": (a.n_kv_heads, "kv_heads"), "wv": (a.n_kv_heads, "kv_heads")}
        ws = [
            param(self, name, init, (s.d_model, n, a.head_dim), ("embed", axis, "head_dim"), quantized=True)
            for name, (n, axis) in heads.items()
        ]
        # x is kept once for the three backward products
        qkv = matmuls(s, x, ["btd,dnh->btnh"] * 3, ws, block=True, history=fp8_history(self, "qkv", 3))
        qkv = [
            y + lora_delta(self, s, name, x, "btd,dnh->btnh", (s.d_model, n, a.head_dim), ("embed", axis, "head_dim"))
            if targeted(s, name)
            else y
            for y, (name, (n, axis)) in zip(qkv, heads.items())
        ]
        if s.use_bias or a.qkv_bias:
            qkv = [
                y + param(self, name + "_bias", nn.initializers.zeros, (n, a.head_dim), (axis, "head_dim")).astype(dt)
                for y, (name, (n, axis)) in zip(qkv, heads.items())
            ]
        q = c(qkv[0], ("batch", "length", "act_heads", None))
        k, v = (c(y, ("batch", "length", "act_kv_heads", None)) for y in qkv[1:])
        if a.qk_norm:
            q, k = Norm(s, a.head_dim, name="q_norm")(q), Norm(s, a.head_dim, name="k_norm")(k)
        if local is not None:  # this layer's half of each (global, local) pair
            pick = lambda pair: jax.tree.map(lambda g, loc: jnp.where(local, loc, g), *pair)
            rope_cs = pick(rope_cs) if rope_cs is not None else None
            cache_mask = pick(cache_mask) if cache_mask is not None else None
        if rope_cs is not None:
            q, k = apply_rope(q, rope_cs), apply_rope(k, rope_cs)
        if self.decode and self.paging is not None:
            y = self._attend_pages(q, k, v, *cache_slots, cache_mask, local)
        elif self.decode:
            y = self._attend_cache(q, k, v, cache_slots, cache_mask)
        else:
            window = None if local is None else jnp.where(local, a.sliding_window, x.shape[1] + 1)
            y = attend(
                q,
                k,
                v,
                segment_ids,
                a.kernel,
                window,
                a.scale,
                a.softcap,
                self.part,
                local,
                a.sliding_window,
                a.context,
            )
        y = c(y, ("batch", "length", "act_heads", None))
        wo_names = ("q_heads", "head_dim", "embed")
        wo = param(self, "wo", out_init, (a.n_heads, a.head_dim, s.d_model), wo_names, quantized=True)
        history = fp8_history(self, "o", 1)
        if self.decode:  # heads flattened on both sides: XLA:CPU would otherwise re-lay-out wo every step
            b, t = y.shape[:2]
            out = matmul(s, "btf,fd->btd", y.reshape(b, t, -1), wo.reshape(-1, s.d_model), block=True, history=history)
        else:
            out = matmul(s, "btnh,nhd->btd", y, wo, block=True, history=history)
        if targeted(s, "wo"):
            out = out + lora_delta(
                self, s, "wo", y, "btnh,nhd->btd", (a.n_heads, a.head_dim, s.d_model), ("q_heads", "head_dim", "embed")
            )
        if s.use_bias:
            out = out + param(self, "wo_bias", nn.initializers.zeros, (s.d_model,), ("embed",)).astype(dt)
        return c(out, ("batch", "length", "act_embed"))

    def _attend_cache(self, q, k, v, slots, mask):
        """Writes this step's keys and values into the cache, then attends to all of it.

        The cache's length is the token count of the call that creates it (`init_cache`).
        """
        s, a = self.spec, self.spec.attention
        shape = (k.shape[0], a.n_kv_heads, k.shape[1], a.head_dim)
        zeros = nn.with_logical_partitioning(jnp.zeros, CACHE_AXES)
        k_cache = self.variable("cache", "k", zeros, shape, s.dtype)
        v_cache = self.variable("cache", "v", zeros, shape, s.dtype)
        k_cache.value = write_cache(k_cache.value, k, slots)
        v_cache.value = write_cache(v_cache.value, v, slots)
        return cached_attention(q, k_cache.value, v_cache.value, mask, a.scale, a.softcap)

    def _attend_pages(self, q, k, v, write, read, mask, local=None):
        """Writes this step's keys and values into the page pool, then attends to the rows each
        sequence's page table names (lm.model.paged); a decode step the TPU's paged kernel takes
        reads the pages in place (lm.model.paged_kernel)."""
        s, a, pg = self.spec, self.spec.attention, self.paging
        shape = (a.n_kv_heads, pg.tokens, a.head_dim)
        pool_dtype = KV_DTYPES[pg.kv] or s.dtype
        zeros = nn.with_logical_partitioning(jnp.zeros, POOL_AXES)
        k_pool = self.variable("cache", "k", zeros, shape, pool_dtype)
        v_pool = self.variable("cache", "v", zeros, shape, pool_dtype)
        if pg.kv != "int8":
            k_pool.value = write_pool(k_pool.value, k, write)
            v_pool.value = write_pool(v_pool.value, v, write)
            if paged_kernel.takes(a.kernel, self.part, q.shape, k_pool.value, pg.page_size, local):
                return paged_kernel.paged_decode(
                    q, k_pool.value, v_pool.value, read, mask, a.scale, a.softcap, pg.page_size, self.part
                )
            keys = read_pool(k_pool.value, read, in_place=pg.in_place).astype(s.dtype)
            values = read_pool(v_pool.value, read, in_place=pg.in_place).astype(s.dtype)
        else:
            scale_zeros = nn.with_logical_partitioning(jnp.zeros, SCALE_AXES)
            k_scale = self.variable("cache", "k_scale", scale_zeros, shape[:2], jnp.float32)
            v_scale = self.variable("cache", "v_scale", scale_zeros, shape[:2], jnp.float32)
            for pool, scale, new in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
                values_q, scales = quantize_kv(new)
                pool.value = write_pool(pool.value, values_q, write)
                scale.value = write_pool(scale.value, scales, write)
            keys = read_pool(k_pool.value, read, k_scale.value, s.dtype, pg.in_place)
            values = read_pool(v_pool.value, read, v_scale.value, s.dtype, pg.in_place)
        return paged_attention(q, keys, values, mask, a.scale, a.softcap)
