"""Fused attention kernels that honour packed documents, as shipped in jax's Pallas ops.

- TPU, `splash`: splash attention (block-sparse flash attention). It takes segment ids, grouped
  kv heads, a causal or sliding-window mask and the logit soft cap, with its own backward pass.
- GPU, `flash`: Pallas's Triton flash attention. It takes segment ids and a causal mask, with its
  own backward pass; grouped kv heads are repeated to the query heads first (the kernel pairs
  query head i with key head i). It has no window and no soft cap: such layers (Gemma 2, local
  layers shorter than the sequence) run `blockwise` instead.

Neither kernel materialises [B, N, T, T] scores, and packed documents never see each other
(a query sees a key iff same segment id, key <= query, and within the window). A kernel runs
once per device on its shard of the batch and of the heads (`shard_map` over the partitioning's
mesh: Pallas calls are not split by the compiler); the sequence stays whole on each device, so
with the sequence split over `context` (mesh.context > 1) neither kernel runs: attention takes
lm.model.ring_attention's allgather or ring path (XLA products) instead. On
any backend but its own a kernel runs in Pallas's interpreter: slow, and meant for checking it
(tests/model/test_fused_attention.py, on CPU or on the other accelerator), never for training.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.sharding import split_count

BLOCK = 128  # the kernels' tile: they take sequence lengths that are multiples of it
AUTO = {"tpu": "splash", "gpu": "flash"}  # what model.attention="auto" picks; elsewhere blockwise
NATIVE = {kernel: backend for backend, kernel in AUTO.items()}  # elsewhere a kernel is interpreted


def platform(part) -> str:
    """The backend a model's arrays live on: its mesh's devices (a TPU topology when compiling
    ahead of time on a CPU host), or the default backend without a mesh."""
    return part.mesh.devices.flat[0].platform if part.mesh is not None else jax.default_backend()


def resolve(kernel: str, part) -> str:
    """model.attention with "auto" replaced by the backend's kernel."""
    return AUTO.get(platform(part), "blockwise") if kernel == "auto" else kernel


def takes(kernel: str, t: int, window: int | None, cap: float) -> bool:
    """Whether fused `kernel` runs a layer of sequence length t with this window and soft cap."""
    if kernel not in ("splash", "flash") or t % BLOCK:
        return False
    return kernel == "splash" or (window is None and not cap)


def fused_attention(kernel, q, k, v, segment_ids, part, scale: float, cap: float, window: int | None):
    """q [B,T,N,H], k/v [B,T,K,H], segment_ids [B,T] -> [B,T,N,H], causal within documents (and
    within `window` keys, the query's own included). scale: the logits' factor (0: 1/sqrt(H))."""
    interpret = platform(part) != NATIVE[kernel]
    scale = scale or q.shape[-1] ** -0.5
    if kernel == "flash":
        k, v = _repeat_kv(q, k, v)
        run = functools.partial(_flash, scale=scale, interpret=interpret)
    else:
        run = functools.partial(_splash, scale=scale, cap=cap, window=window, interpret=interpret)
    if part.mesh is None:
        return run(q, k, v, segment_ids)
    return _per_device(run, part, q, k, v, segment_ids)


def _per_device(run, part, q, k, v, segment_ids):
    """`run` on each device's shard: batch over the batch axes, heads over the head axes."""
    spec = lambda names: P(*nn.logical_to_mesh_axes(names, part.rules))  # noqa: E731
    q_spec = spec(("batch", "length", "act_heads", None))
    kv_spec = spec(("batch", "length", "act_kv_heads", None))
    heads = lambda s, n: n // split_count(part.mesh, s[2])  # noqa: E731
    if heads(q_spec, q.shape[2]) % heads(kv_spec, k.shape[2]) or k.shape[2] % split_count(part.mesh, kv_spec[2]):
        # each device's query heads must be whole groups of its kv heads: repeat the kv heads
        (k, v), kv_spec = _repeat_kv(q, k, v), q_spec
    if split_count(part.mesh, q_spec[1]) > 1:  # attend routes such calls to lm.model.ring_attention
        raise ValueError("fused attention keeps the sequence whole on each device: the 'length' axis is sharded")
    return jax.shard_map(
        run,
        mesh=part.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, spec(("batch", "length"))),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def _repeat_kv(q, k, v):
    """k and v with each kv head repeated for its group of query heads: one kv head per query head."""
    groups = q.shape[2] // k.shape[2]
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def _splash(q, k, v, segment_ids, *, scale, cap, window, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    t, n = q.shape[1], q.shape[2]
    mask = sm.CausalMask((t, t)) if window is None else sm.LocalMask((t, t), (window - 1, 0), offset=0)
    block = _block(t)
    sizes = sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([mask] * n),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        attn_logits_soft_cap=cap or None,
        interpret=interpret,
    )
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=sk.SegmentIds(s1, s1)))(
        heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), segment_ids
    )
    return heads_first(out)


def _flash(q, k, v, segment_ids, *, scale, interpret):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    block = min(BLOCK, q.shape[1])
    sizes = gpu_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    return gpu_attention.mha(q, k, v, segment_ids, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)


def _block(t: int) -> int:
    """The largest of 512, 256 and 128 that divides t (splash's tile along both sequence axes)."""
    return next(b for b in (512, 256, BLOCK) if t % b == 0)
