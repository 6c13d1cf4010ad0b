"""Decode steps over the paged KV pool with jax's Pallas TPU paged-attention kernel.

The XLA path (`lm.model.attention.paged_attention`) gathers every row's whole page table into
[kv_heads, B, S, head_dim] on each layer of each step and masks what the query may not see. The
kernel reads each row's pages straight from the pool (DMA, double-buffered) and stops at the row's
length, so a step reads only the tokens it attends to and copies none.

What it takes (`takes`): one query per row (a decode step, t=1) of a global layer, whose mask is a
prefix of the row's table (length = position + 1; 0 for padding rows, whose output is zeros); a
bfloat16 pool (the kernel casts keys and values to bfloat16, so a float32 pool would lose
precision); head_dim a multiple of 128 and pages of a size that fits the kernel's VMEM buffers on
a TPU. It does not scale the queries: they come scaled. It runs once per device under `shard_map`
(Pallas calls are not split by the compiler): rows over the batch axes, heads over the kv-head axes,
the pool's token rows whole on each device, since the page table names pages of the whole pool. On
the CPU backend it runs in the TPU interpreter, which is how the tests check it.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.model import fused_attention as fused
from lm.model.paged import POOL_AXES
from lm.sharding import split_count

BLOCK_TOKENS = 512  # tokens per compute block the page count per block aims at
BLOCK_PAGES = (16, 8, 4, 2, 1)  # pages per compute block tried, largest first: one must divide the table
# page_size * head_dim at most this: the double-buffered bf16 pages and their float32 copies stay in
# the 16 MiB of VMEM a TPU kernel gets by default (2**21 fails to compile on a v5e, 2**20 fits)
VMEM_ELEMENTS = 2**19
LANES = 128  # the TPU lowering's minor tile: head_dim must be a multiple of it


def takes(kernel: str, part, q_shape, pool, page_size: int, local) -> bool:
    """Whether a decode call of queries [B,t,N,H] against one layer's pool [K, pages*page_size, H]
    runs the kernel: model.attention resolves to splash (the TPU's kernel), t == 1, a bfloat16 pool,
    no local (sliding-window) layers (local: this layer's flag, None without them), a sharding that
    gives each device whole groups of heads, and on a TPU a head_dim and pages its lowering takes
    (the interpreter on CPU has no such limits)."""
    b, t, n, h = q_shape
    where = fused.platform(part)
    if fused.resolve(kernel, part) != "splash" or where not in ("tpu", "cpu") or t != 1 or local is not None:
        return False
    if pool.dtype != jnp.bfloat16:  # int8 and float32 pools stay on the XLA path
        return False
    if where == "tpu" and (h % LANES or page_size * h > VMEM_ELEMENTS):
        return False
    return part.mesh is None or _specs(part, b, n, pool.shape[0]) is not None


def paged_decode(q, k_pool, v_pool, read, mask, scale: float, cap: float, page_size: int, part):
    """q [B,1,N,H] against the pools [K, pages*page_size, H] (this step's keys already written) at the
    rows `read` [B,S] (whole pages, in table order) under a prefix mask [B,1,S] -> [B,1,N,H].
    scale: the logits' factor (0: 1/sqrt(H)); cap: their soft cap (0: none)."""
    b, _, n, h = q.shape
    k = k_pool.shape[0]
    # the pool's token rows are pages of page_size: a reshape; the table is each page's first row
    pages = lambda x: x.reshape(x.shape[0], -1, page_size, h)  # noqa: E731
    table = (read[:, ::page_size] // page_size).astype(jnp.int32)
    lengths = jnp.sum(mask[:, 0], axis=-1, dtype=jnp.int32)
    q = q[:, 0] * jnp.asarray(scale or h**-0.5, q.dtype)  # the kernel takes scaled queries
    run = functools.partial(
        _kernel, block=_block(table.shape[1], page_size), cap=cap, interpret=fused.platform(part) == "cpu"
    )
    if part.mesh is None:
        out = run(q, pages(k_pool), pages(v_pool), lengths, table)
    else:
        q_spec, pool_spec, rows = _specs(part, b, n, k)
        out = jax.shard_map(
            lambda q, kp, vp, lengths, table: run(q, pages(kp), pages(vp), lengths, table),
            mesh=part.mesh,
            in_specs=(q_spec, pool_spec, pool_spec, P(rows), P(rows, None)),
            out_specs=q_spec,
            check_vma=False,
        )(q, k_pool, v_pool, lengths, table)
    return out[:, None]


def _specs(part, b: int, n: int, k: int):
    """(q spec, pool spec, row axes) of the per-device calls, or None where a device would not hold
    whole rows, its query heads' own kv heads (the same mesh axes, dividing both head counts) and
    every page of the pool."""
    axes = lambda names: nn.logical_to_mesh_axes(names, part.rules)  # noqa: E731
    rows, heads = axes(("batch", "act_heads"))
    pool = axes(POOL_AXES)
    count = lambda a: split_count(part.mesh, a)  # noqa: E731
    if (
        pool[0] != heads
        or n % count(heads)
        or k % count(heads)
        or b % count(rows)
        or count(pool[1]) * count(pool[2]) > 1
    ):
        return None
    return P(rows, heads, None), P(heads, None, None), rows


def _kernel(q, k_pages, v_pages, lengths, table, *, block: int, cap: float, interpret: bool):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        return paged_attention(
            q, k_pages, v_pages, lengths, table, attn_logits_soft_cap=cap or None, pages_per_compute_block=block
        )


def _block(width: int, page_size: int) -> int:
    """Pages per compute block: the largest of BLOCK_PAGES that divides the table's width (the
    kernel's condition) and keeps a block within BLOCK_TOKENS tokens (one page at least)."""
    return next(p for p in BLOCK_PAGES if width % p == 0 and (p * page_size <= BLOCK_TOKENS or p == 1))
