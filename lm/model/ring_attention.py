"""Attention with the sequence split over the mesh's `context` axis (context parallelism).

When the rule table puts the activations' `length` axis on mesh axes of C > 1 devices (the
`context` axis by default: `mesh.context`), each device holds T / C tokens of every activation,
so no device ever holds a [T, D] stream or [T, T] scores of a whole sequence. Only attention
mixes tokens; it runs in a `shard_map` over the mesh, each device on its rows, heads and tokens,
by one of two strategies (`model.context_attention`):

- `allgather`: each device gathers the keys, values and segment ids of the whole sequence over
  `context` and attends with its own queries (T/C x T scores); the backward reduce-scatters the
  key and value gradients. Simple, and the gathered keys and values cost T x kv-heads per device.
- `ring`: key and value blocks (with their segment ids) travel round the `context` devices with
  `jax.lax.ppermute`, C steps, while each device folds each block into its queries' output by the
  online softmax (running max, sum and weighted values in float32). Causal work is balanced: the
  sequence is cut into 2C chunks and device i holds chunks i and 2C-1-i (a permutation of the
  contiguous split, two ppermutes of half a shard on the way in and the same on the way out).
  Every step after the first then has exactly half of its block visible (the earlier chunk's keys
  for all queries, or all keys for the later chunk's queries), and only that half is computed.

The mask uses each token's global index, so it equals the unsplit model's: query i sees key j iff
j <= i, both have the same segment id (packed documents, also across a shard boundary), and
i - j < window on sliding-window layers. Grouped kv heads are never repeated unless the rule
table splits query and kv heads differently.

Kernels: the fused kernels (splash, Pallas flash) are not used here; both strategies run XLA
products with a float32 softmax. `allgather`'s backward is autodiff's (it keeps T/C x T
probabilities per device); the ring has its own (lm.model.ring_flash: flash attention's backward
round the ring, query blocks of 512, no step's probabilities kept). A call this module
cannot split evenly (rows, heads or tokens that do not divide, as a batch-1 init) or a pipeline's
stage (run under vmap) falls back to the unsplit XLA path, which the partitioner splits itself.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.model.pipeline import stages_of
from lm.model.ring_flash import ring_core, visible
from lm.sharding import split_count

F32 = jnp.float32
MASKED = float(jnp.finfo(F32).min)
STRATEGIES = ("allgather", "ring")


def _axes(part, name: str) -> tuple:
    axes = nn.logical_to_mesh_axes((name,), part.rules)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def context_shards(part) -> int:
    """How many ways the rule table splits the sequence on the partitioning's mesh (1: no mesh)."""
    return 1 if part.mesh is None else split_count(part.mesh, _axes(part, "length") or None)


def takes(part, strategy: str, q, k) -> bool:
    """Whether `strategy` runs this call split over the sequence: every split divides evenly."""
    c = context_shards(part)
    if c == 1 or stages_of(part) > 1 or strategy not in STRATEGIES:
        return False
    (b, t, n, _), kv = q.shape, k.shape[2]
    chunks = c * (2 if strategy == "ring" else 1)
    count = lambda name: split_count(part.mesh, _axes(part, name) or None)  # noqa: E731
    return not (b % count("batch") or t % chunks or n % count("act_heads") or kv % count("act_kv_heads"))


def context_attention(strategy, q, k, v, segment_ids, part, window=None, scale: float = 0.0, cap: float = 0.0):
    """q [B,T,N,H], k/v [B,T,K,H], segment_ids [B,T] (all split over the sequence by the rule
    table) -> [B,T,N,H], causal within documents and `window` (None or a traced scalar: keys a
    query sees, itself included). scale: the logits' factor (0: 1/sqrt(H)); cap: their soft cap."""
    spec = lambda names: P(*nn.logical_to_mesh_axes(names, part.rules))  # noqa: E731
    q_spec = spec(("batch", "length", "act_heads", None))
    kv_spec = spec(("batch", "length", "act_kv_heads", None))
    if q_spec[2] != kv_spec[2]:  # each device's query heads must be whole groups of its kv heads
        groups = q.shape[2] // k.shape[2]
        k, v, kv_spec = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2), q_spec
    axes = _axes(part, "length")
    size = split_count(part.mesh, axes)
    scale = scale or q.shape[-1] ** -0.5
    local = _allgather if strategy == "allgather" else _ring
    args, specs = (q, k, v, segment_ids), (q_spec, kv_spec, kv_spec, spec(("batch", "length")))
    if window is not None:
        args, specs = args + (jnp.asarray(window, jnp.int32),), specs + (P(),)

    def run(q, k, v, seg, window=None):
        return local(q, k, v, seg, window, axes=axes, size=size, scale=scale, cap=cap)

    return jax.shard_map(run, mesh=part.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def _allgather(q, k, v, seg, window, *, axes, size, scale, cap):
    """One device: its queries against the gathered keys of the whole sequence."""
    del size
    tq = q.shape[1]
    k, v, seg_k = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v, seg))
    idx_q = jax.lax.axis_index(axes) * tq + jnp.arange(tq)
    mask = visible(seg, seg_k, idx_q, jnp.arange(k.shape[1]), window)
    s = jnp.where(mask, _scores(q, k, scale, cap), MASKED)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=F32)
    return out.astype(q.dtype).reshape(q.shape)


def _ring(q, k, v, seg, window, *, axes, size, scale, cap):
    """One device: its two balanced chunks of queries against every device's keys, block by block
    (lm.model.ring_flash, with its own backward pass)."""
    me = jax.lax.axis_index(axes)
    q, k, v, seg = (_balance(x, axes, size, me) for x in (q, k, v, seg))
    b, t, n, h = q.shape
    kvh = k.shape[2]
    qh = q.reshape(b, t, kvh, n // kvh, h).transpose(0, 2, 3, 1, 4)
    out = ring_core(qh, k, v, seg, window, axes, size, float(scale), float(cap or 0.0))
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    return _unbalance(out, axes, size, me)


def _scores(q, k, scale, cap):
    """q [b,tq,N,h], k [b,tk,K,h] -> float32 logits [b,K,N/K,tq,tk], scaled and soft-capped."""
    b, tq, n, h = q.shape
    kvh = k.shape[2]
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, tq, kvh, n // kvh, h), k, preferred_element_type=F32) * scale
    return jnp.tanh(s / cap) * cap if cap else s


def _holder(chunk: int, size: int) -> int:
    """The device holding `chunk` (of 2 * size) in the balanced layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _balance(x, axes, size: int, me):
    """Contiguous (device i: chunks 2i, 2i+1) -> balanced (device i: chunks i, 2C-1-i) along axis 1.
    The even chunks go to distinct devices, and so do the odd ones: two ppermutes."""
    half = x.shape[1] // 2
    even = jax.lax.ppermute(x[:, :half], axes, [(i, _holder(2 * i, size)) for i in range(size)])
    odd = jax.lax.ppermute(x[:, half:], axes, [(i, _holder(2 * i + 1, size)) for i in range(size)])
    first_even = me % 2 == 0  # chunk `me` is even iff me is; 2C-1-me has the other parity
    return jnp.concatenate([jnp.where(first_even, even, odd), jnp.where(first_even, odd, even)], axis=1)


def _unbalance(x, axes, size: int, me):
    """The inverse of `_balance`: chunk c goes back to device c // 2, half c % 2."""
    half = x.shape[1] // 2
    first_even = me % 2 == 0
    first, second = x[:, :half], x[:, half:]
    even, odd = jnp.where(first_even, first, second), jnp.where(first_even, second, first)
    even_chunk = lambda i: i if i % 2 == 0 else 2 * size - 1 - i  # noqa: E731
    odd_chunk = lambda i: 2 * size - 1 - i if i % 2 == 0 else i  # noqa: E731
    back_even = jax.lax.ppermute(even, axes, [(i, even_chunk(i) // 2) for i in range(size)])
    back_odd = jax.lax.ppermute(odd, axes, [(i, odd_chunk(i) // 2) for i in range(size)])
    return jnp.concatenate([back_even, back_odd], axis=1)
