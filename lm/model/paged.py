"""The paged KV cache: keys and values live in a pool of fixed-size pages shared by all sequences.

A sequence owns a list of pages (its row of the page table); position p of the sequence is token
`p % page_size` of page `table[p // page_size]`. Per layer the pool holds keys and values
[kv_heads, pages * page_size, head_dim] in the compute dtype, or as int8 with one float32 scale per
kv head and token, or as float8 (e4m3, no scale: a cast each way, as vLLM's fp8 cache with its
default scale of 1).

A step gathers a sequence's keys through its page table into [kv_heads, B, S, head_dim] (S = the
table's width × page_size), which folds into one batch axis without a copy, so `paged_attention`
runs the same products as the dense cache's `cached_attention`. Positions past a sequence's own
tokens may hold another sequence's stale entries; the causal mask (slot <= position) never lets a
query see them, and unused table entries point at page 0, which the engine never hands out.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

POOL_AXES = ("kv_heads", "cache_pool", "head_dim")
SCALE_AXES = ("kv_heads", "cache_pool")
KV_DTYPES = {"": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # None: the compute dtype
NOWHERE = jnp.iinfo(jnp.int32).max  # a write index past any pool: dropped


@dataclasses.dataclass(frozen=True)
class Paging:
    """The pool's static shape: `pages` pages of `page_size` tokens; kv: "" (the compute dtype),
    "int8" (int8 keys and values with a float32 scale per token and kv head: about half the bytes
    of bfloat16) or "fp8" (float8_e4m3fn, half the bytes of bfloat16; the TPU's paged kernel then
    stays out).
    in_place: this call's rows are all the pool's slots in order, each owning the same number of
    consecutive pages (the engine's slot-major layout) and its table covering them all, so the pool
    is read as it lies ([kv_heads, rows, positions, head_dim] is a reshape, not a gather)."""

    page_size: int
    pages: int
    kv: str = ""
    in_place: bool = False

    def __post_init__(self):
        if self.kv not in KV_DTYPES:
            raise ValueError(f"paging: kv={self.kv!r}: expected one of {sorted(KV_DTYPES)}")

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
    """pool [K, P, ...] with new [B, t, K, ...] written at pool rows `write` [B, t] (NOWHERE: dropped)."""
    flat = jnp.moveaxis(new.reshape(-1, *new.shape[2:]), 0, 1)
    return pool.at[:, write.reshape(-1)].set(flat.astype(pool.dtype), mode="drop")


def read_pool(pool, read, scale=None, dtype=None, in_place: bool = False):
    """The rows `read` [B, S] of pool [K, P, H] as [K, B, S, H] (dequantized with `scale` [K, P]);
    in_place: the pool holds exactly those rows in that order (a reshape)."""
    take = (lambda x: x.reshape(x.shape[0], *read.shape, *x.shape[2:])) if in_place else (lambda x: x[:, read])
    x = take(pool)
    if scale is not None:
        x = (x.astype(jnp.float32) * take(scale)[..., None]).astype(dtype)
    return x
