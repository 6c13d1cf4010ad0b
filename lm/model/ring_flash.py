"""The ring's attention on one device, with a hand-written backward pass (flash attention's, round
the ring): no step's scores or probabilities are kept for the backward.

Called inside `lm.model.ring_attention`'s shard_map, on the device's two balanced chunks of
queries. The forward folds each travelling key/value block into the online softmax and keeps
only the output and the log-sum-exp of every query. The backward goes round the ring once more:
at each step it recomputes the visible block's probabilities from the log-sum-exp, adds its share
of the queries' gradient, and adds the block's key and value gradients into accumulators that
travel with the block; one last hop brings them home. Inside a step the queries go in blocks
of QUERY_BLOCK, so a device holds [QUERY_BLOCK x block keys] float32 scores per head at a time,
whatever the sequence length.

Autodiff of the plain loop kept every step's visible probabilities (T/C x T per device), and its
`lax.cond` kept what both branches needed: 1.3-1.6x the all-gather's memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
MASKED = float(jnp.finfo(F32).min)
QUERY_BLOCK = 512


def chunk_indices(device, size: int, half: int):
    """Global token indices of the two chunks a device holds in the balanced layout: device and 2C-1-device."""
    r = jnp.arange(half)
    return jnp.concatenate([device * half + r, (2 * size - 1 - device) * half + r])


def visible(seg_q, seg_k, idx_q, idx_k, window):
    """[b,1,1,tq,tk] bool: key j is visible to query i (global indices) iff j <= i, same segment
    and i - j < window."""
    causal = idx_k[None, :] <= idx_q[:, None]
    if window is not None:
        causal = causal & (idx_q[:, None] - idx_k[None, :] < window)
    return (causal[None] & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None, None]


def _logits(q, k, scale, cap):
    """q [b,kvh,g,tq,h], k [b,tk,kvh,h] -> (float32 logits [b,kvh,g,tq,tk], d logits / d raw)."""
    raw = jnp.einsum("bkgth,bskh->bkgts", q, k, preferred_element_type=F32) * scale
    if not cap:
        return raw, None
    s = jnp.tanh(raw / cap) * cap
    return s, 1.0 - jnp.square(s / cap)


def _blocks(n: int) -> int:
    """Query block size for n queries: QUERY_BLOCK when it divides n, else all of them."""
    return QUERY_BLOCK if n > QUERY_BLOCK and n % QUERY_BLOCK == 0 else n


def _by_query_block(fn, qs_arrays, carry=None):
    """Runs fn(carry, *block_arrays) -> (carry, out) over query blocks of the [..., tq, ...] arrays
    (the query axis is axis 3 of [b,kvh,g,tq(,h)] arrays, axis 1 of [b,tq] and 0 of [tq]); outs
    are put back together along the query axis."""
    tq = qs_arrays[-1].shape[0]  # the last array is the queries' global indices [tq]
    qb = _blocks(tq)
    n = tq // qb
    axes = [3 if a.ndim >= 4 else 1 if a.ndim == 2 else 0 for a in qs_arrays]
    split = [jnp.moveaxis(a.reshape(*a.shape[:ax], n, qb, *a.shape[ax + 1 :]), ax, 0) for a, ax in zip(qs_arrays, axes)]
    carry, outs = jax.lax.scan(lambda c, xs: fn(c, *xs), carry, split)
    merge = lambda o, ax: jnp.moveaxis(o, 0, ax).reshape(*o.shape[1 : ax + 1], tq, *o.shape[ax + 2 :])  # noqa: E731
    return carry, jax.tree.map(lambda o: merge(o, 3 if o.ndim >= 5 else 1 if o.ndim == 3 else 0), outs)


def _fold(acc, q, seg_q, idx_q, k, v, seg_k, idx_k, window, scale, cap):
    """The online softmax's (max, sum, weighted values) of queries q after also seeing keys k."""

    def block(_, top, total, weighted, q, seg_q, idx_q):
        s, _ = _logits(q, k, scale, cap)
        mask = visible(seg_q, seg_k, idx_q, idx_k, window)
        s = jnp.where(mask, s, MASKED)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - new_top[..., None]), 0.0)
        fade = jnp.exp(top - new_top)
        pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=F32)
        return None, (new_top, total * fade + jnp.sum(p, axis=-1), weighted * fade[..., None] + pv)

    return _by_query_block(block, (*acc, q, seg_q, idx_q))[1]


def _fold_grad(grads, q, seg_q, idx_q, lse, g, delta, k, v, seg_k, idx_k, window, scale, cap):
    """(dq of these queries, dk, dv of this block) += what keys k contributed to the output."""
    dq, dk, dv = grads

    def block(kv_grads, q, seg_q, lse, g, delta, idx_q):
        dk, dv = kv_grads
        s, dcap = _logits(q, k, scale, cap)
        p = jnp.where(visible(seg_q, seg_k, idx_q, idx_k, window), jnp.exp(s - lse[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgts,bkgth->bskh", p.astype(g.dtype), g, preferred_element_type=F32)
        dp = jnp.einsum("bkgth,bskh->bkgts", g, v, preferred_element_type=F32)
        ds = p * (dp - delta[..., None])
        ds = (ds if dcap is None else ds * dcap) * scale
        dk = dk + jnp.einsum("bkgts,bkgth->bskh", ds.astype(q.dtype), q, preferred_element_type=F32)
        return (dk, dv), jnp.einsum("bkgts,bskh->bkgth", ds.astype(k.dtype), k, preferred_element_type=F32)

    (dk, dv), dq_part = _by_query_block(block, (q, seg_q, lse, g, delta, idx_q), (dk, dv))
    return dq + dq_part, dk, dv


def _keys(block, ks, idx_k):
    """(keys, values, segment ids, global indices) of a travelling block's slice `ks`."""
    k, v, seg_k = block[:3]
    return k[:, ks], v[:, ks], seg_k[:, ks], idx_k[ks]


def _hop(x, axes, size):
    """x sent one device on round the ring."""
    return jax.lax.ppermute(x, axes, [(i, (i + 1) % size) for i in range(size)])


def _ring_steps(me, axes, size, half, update, state, block):
    """Runs `update(state, block, qs, ks, idx_k)` for each of the `size` blocks travelling round the
    ring, only on the visible half of each later step; returns (state, the last block)."""
    for step in range(size):
        src = (me - step) % size  # the device whose keys this block holds
        idx_k = chunk_indices(src, size, half)
        if step == 0:  # its own chunks: causal within them
            state, block = update(state, block, slice(None), slice(None), idx_k)
        else:  # an earlier device: all queries see its first chunk; a later one: the second chunk sees all
            state, block = jax.lax.cond(
                src < me,
                lambda sb: update(*sb, slice(None), slice(None, half), idx_k),
                lambda sb: update(*sb, slice(half, None), slice(None), idx_k),
                (state, block),
            )
        if step < size - 1:
            block = jax.tree.map(lambda x: _hop(x, axes, size), block)
    return state, block


def _forward(q, k, v, seg, window, me, axes, size, scale, cap):
    """q [b,kvh,g,t,h] (balanced chunks), k/v [b,t,kvh,h] -> (out [b,kvh,g,t,h] float32, lse [b,kvh,g,t])."""
    b, kvh, g, t, h = q.shape
    half = t // 2
    idx_q = chunk_indices(me, size, half)
    acc = (jnp.full((b, kvh, g, t), MASKED, F32), jnp.zeros((b, kvh, g, t), F32), jnp.zeros((b, kvh, g, t, h), F32))

    def update(acc, block, qs, ks, idx_k):
        part = tuple(a[..., qs] if a.ndim == 4 else a[..., qs, :] for a in acc)
        new = _fold(part, q[..., qs, :], seg[:, qs], idx_q[qs], *_keys(block, ks, idx_k), window, scale, cap)
        acc = tuple(a.at[..., qs].set(n) if a.ndim == 4 else a.at[..., qs, :].set(n) for a, n in zip(acc, new))
        return acc, block

    (top, total, weighted), _ = _ring_steps(me, axes, size, half, update, acc, (k, v, seg))
    safe = jnp.where(total > 0, total, 1.0)
    return weighted / safe[..., None], top + jnp.log(safe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def ring_core(q, k, v, seg, window, axes, size, scale, cap):
    """One device's attention of its balanced queries q [b,kvh,g,t,h] over the whole ring's keys
    (k, v [b,t,kvh,h], seg [b,t] its own chunks): [b,kvh,g,t,h] float32."""
    return _forward(q, k, v, seg, window, jax.lax.axis_index(axes), axes, size, scale, cap)[0]


def _core_fwd(q, k, v, seg, window, axes, size, scale, cap):
    out, lse = _forward(q, k, v, seg, window, jax.lax.axis_index(axes), axes, size, scale, cap)
    return out, (q, k, v, seg, window, out, lse)


def _core_bwd(axes, size, scale, cap, saved, g):
    q, k, v, seg, window, out, lse = saved
    me = jax.lax.axis_index(axes)
    half = q.shape[3] // 2
    idx_q = chunk_indices(me, size, half)
    g = g.astype(q.dtype)
    delta = jnp.sum(g.astype(F32) * out, axis=-1)  # the softmax backward's row term

    def update(dq, block, qs, ks, idx_k):
        dk, dv = block[3:]
        queries = (q[..., qs, :], seg[:, qs], idx_q[qs], lse[..., qs], g[..., qs, :], delta[..., qs])
        grads = (dq[..., qs, :], dk[:, ks], dv[:, ks])
        dq_part, dk_part, dv_part = _fold_grad(grads, *queries, *_keys(block, ks, idx_k), window, scale, cap)
        return dq.at[..., qs, :].set(dq_part), (*block[:3], dk.at[:, ks].set(dk_part), dv.at[:, ks].set(dv_part))

    zeros = jnp.zeros(k.shape, F32)
    dq, (_, _, _, dk, dv) = _ring_steps(
        me, axes, size, half, update, jnp.zeros(q.shape, F32), (k, v, seg, zeros, zeros)
    )
    dk, dv = (_hop(x, axes, size) for x in (dk, dv))  # the last hop: each block's gradients reach its device
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_core.defvjp(_core_fwd, _core_bwd)
