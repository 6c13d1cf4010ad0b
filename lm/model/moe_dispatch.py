"""How dropless experts run on a backend: the grouped matmul, and moving routed rows between expert shards.

- Grouped matmul: rows sorted by expert times each expert's matrix. On TPU megablox's `gmm`
  (a Pallas kernel that visits only the tiles holding some group's rows, with its own backward
  pass); elsewhere `jax.lax.ragged_dot` (XLA's grouped dot: cuBLAS grouped GEMMs on GPU).
  Rows past the last group are outside every group: gmm leaves them unwritten, so they are
  zeroed on the way in and out (in the forward pass and, through the `where`s, the backward).
- Ragged exchange: on a mesh each device sends each (token, expert) assignment only to the
  device holding that expert and gets the expert's output back (`jax.lax.ragged_all_to_all`),
  instead of every device gathering every row of its expert peers. XLA:CPU does not implement
  that collective, so on CPU the same semantics run as a padded `all_to_all` plus a scatter
  (as many bytes as gathering every row: for checking on simulated devices, not for speed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

NATIVE_EXCHANGE = ("tpu", "gpu")  # backends whose XLA implements ragged_all_to_all


def _tile(dim: int, choices=(1024, 512, 256, 128)) -> int:
    return next((c for c in choices if dim % c == 0), dim)


def grouped_dot(kind: str, sizes: jax.Array, interpret: bool = False):
    """(rows [M, k] sorted by group, w [G, k, n]) -> [M, n] in rows' dtype; sizes [G] int32: the
    rows of each group in order (their sum may be < M: the rest belong to no group and give 0)."""
    if kind != "gmm":
        return lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32).astype(a.dtype)

    def dot(a, w):
        m = a.shape[0]
        tm = 512 if m >= 2048 else 128
        padded = -(-m // tm) * tm
        inside = (jnp.arange(m) < jnp.sum(sizes))[:, None]
        a_in = jnp.pad(jnp.where(inside, a, 0), ((0, padded - m), (0, 0)))
        tiling = (tm, _tile(w.shape[1]), _tile(w.shape[2]))
        out = megablox.gmm(a_in, w.astype(a.dtype), sizes, jnp.float32, tiling, None, None, False, interpret)
        return jnp.where(inside, out[:m], 0).astype(a.dtype)

    return dot


RAGGED_DOT = functools.partial(grouped_dot, "ragged_dot")


def grouped_kernel(backend: str):
    """sizes -> the grouped matmul for arrays on `backend`: megablox gmm on TPU, else ragged_dot."""
    return functools.partial(grouped_dot, "gmm") if backend == "tpu" else RAGGED_DOT


def exchange_plan(dest: jax.Array, peers: int, axes):
    """The four ragged_all_to_all vectors for sending rows sorted by destination: dest [A] is each
    row's peer along `axes` (`peers`: no peer, never sent). Returns (input offsets, send sizes,
    output offsets on the receivers, receive sizes), each [peers] int32."""
    send = jnp.bincount(dest, length=peers + 1)[:peers].astype(jnp.int32)
    every = jax.lax.all_gather(send, axes)  # [peers, peers]: row i is what peer i sends to each
    me = jax.lax.axis_index(axes)
    before_me = jnp.cumsum(every, axis=0) - every  # rows peers before i send to each receiver
    return jnp.cumsum(send) - send, send, before_me[me], every[:, me]


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, native: bool):
    """`jax.lax.ragged_all_to_all`, or (native False) the same result from a padded all_to_all."""
    if native:
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
        )
    peers, rows = send_sizes.shape[0], operand.shape[0]
    i = jnp.arange(rows)
    chunks = operand[jnp.clip(input_offsets[:, None] + i[None], 0, rows - 1)]  # [peers, rows, ...]
    got = jax.lax.all_to_all(chunks, axes, 0, 0, tiled=True)  # slot j: what peer j sent here
    where = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)  # where peer j's rows land here
    dst = jnp.where(i[None] < recv_sizes[:, None], where[:, None] + i[None], output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(peers * rows, *operand.shape[1:]), mode="drop")


def send_back(rows, output, plan, axes, native: bool):
    """The reverse of the exchange `plan` (from `exchange_plan`): each received row returns to the
    slot of its sender's operand it came from."""
    input_offsets, send, _, recv = plan
    back_offsets = jax.lax.all_to_all(input_offsets, axes, 0, 0, tiled=True)
    return ragged_exchange(rows, output, jnp.cumsum(recv) - recv, recv, back_offsets, send, axes, native)
