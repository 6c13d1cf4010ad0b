"""The paged KV cache: keys and values live in a pool of fixed-size pages shared by all sequences.

A sequence owns a list of pages (its row of the page table); position p of the sequence is token
`p % page_size` of page `table[p // page_size]`. Per layer the pool holds keys and values
[pages * page_size, kv_heads, head_dim] (token-major, so a write is one scatter of whole rows),
optionally as int8 with one float32 scale per token and kv head.

A step reads a sequence's keys back through its page table into the dense [B, kv_heads, S, head_dim]
layout of `cached_attention` (S = the table's width × page_size), so the attention math is the same
as the dense cache's. Positions past a sequence's own tokens may hold another sequence's stale
entries; the causal mask (slot <= position) never lets a query see them, and unused table entries
point at page 0, which the engine never hands out.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

POOL_AXES = ("cache_pool", "kv_heads", "head_dim")
SCALE_AXES = ("cache_pool", "kv_heads")
NOWHERE = jnp.iinfo(jnp.int32).max  # a write index past any pool: dropped


@dataclasses.dataclass(frozen=True)
class Paging:
    """The pool's static shape: `pages` pages of `page_size` tokens; kv_int8 stores int8 keys and
    values with a float32 scale per token and kv head (about half the bytes of bfloat16)."""

    page_size: int
    pages: int
    kv_int8: bool = False

    @property
    def tokens(self) -> int:
        return self.page_size * self.pages


def slots_and_mask(paging: Paging, table, segment_ids, positions):
    """(write index [B,t] into the pool, read index [B,S], mask [B,t,S]) for tokens at `positions`
    of the sequences whose page rows are `table` [B, W]; padding (segment 0) writes nowhere."""
    ps = paging.page_size
    rows = jnp.arange(table.shape[0])[:, None]
    page = table[rows, jnp.clip(positions // ps, 0, table.shape[1] - 1)]
    write = jnp.where(segment_ids != 0, page * ps + positions % ps, NOWHERE)
    view = jnp.arange(table.shape[1] * ps)
    read = table[:, view // ps] * ps + view % ps
    mask = (view[None, None, :] <= positions[:, :, None]) & (segment_ids != 0)[:, :, None]
    return write, read, mask


def quantize_kv(x):
    """[..., H] -> (int8 values, float32 scale [...]): symmetric, one scale per vector."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return q.astype(jnp.int8), scale


def write_pool(pool, new, write):
    """pool [P, K, H] with new [B, t, K, H] written at pool rows `write` [B, t] (NOWHERE: dropped)."""
    return pool.at[write.reshape(-1)].set(new.reshape(-1, *new.shape[2:]).astype(pool.dtype), mode="drop")


def read_pool(pool, read, scale=None, dtype=None):
    """The rows `read` [B, S] of pool [P, K, H] as [B, K, S, H] (dequantized with `scale` [P, K])."""
    x = pool[read]
    if scale is not None:
        x = (x.astype(jnp.float32) * scale[read][..., None]).astype(dtype)
    return x.transpose(0, 2, 1, 3)


def pool_bytes(paging: Paging, n_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of the whole pool, keys and values of every layer."""
    per = kv_heads * head_dim * (1 if paging.kv_int8 else jnp.dtype(dtype).itemsize)
    per += kv_heads * 4 if paging.kv_int8 else 0
    return 2 * n_layers * paging.tokens * per

