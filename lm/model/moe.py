"""Mixture of experts: a router picks `experts_per_token` of `n_experts` SwiGLU experts per token.

Two ways to run the experts over the same params:
- dropless (capacity_factor 0): the (token, expert) assignments sorted by expert and run as
  grouped matmuls (megablox `gmm` on TPU, `jax.lax.ragged_dot` elsewhere), no token ever
  dropped; on a mesh each device routes its own rows and sends each assignment only to the
  expert shard that holds its expert (`sharded_dropless`, lm.model.moe_dispatch);
- capacity (capacity_factor > 0): GShard's dispatch. Each row of the batch is a group; an
  expert takes at most C = ceil(capacity_factor * T * k / E) of a group's assignments (first
  choices before second ones, earlier tokens first), the rest are dropped (the token keeps its
  residual) and counted. Dispatch and combine are einsums over an [E, rows, C, d] buffer whose
  expert axis lies on the `expert` mesh axis: the partitioner turns them into all-to-alls.

Each layer returns routing statistics (lm.model.moe.aux_sums turns the scan's stack of them
into the loss terms and metrics): the load-balancing loss (Switch Transformer:
E * sum_e f_e * P_e, f_e the share of assignments and P_e the mean router probability of expert
e; 1 when balanced), the router z-loss (mean logsumexp(logits)^2, ST-MoE), each expert's load,
and the dropped assignments. Padding tokens (segment 0) count in none of them.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.model.fused_attention import platform
from lm.model.layers import Mlp, Partitioning, normal
from lm.model.moe_dispatch import (
    NATIVE_EXCHANGE,
    RAGGED_DOT,
    exchange_plan,
    grouped_kernel,
    ragged_exchange,
    send_back,
)
from lm.model.params import param
from lm.model.spec import ModelSpec
from lm.sharding import split_count

EXPERT_IN = ("expert", "embed", "expert_mlp")
EXPERT_OUT = ("expert", "expert_mlp", "embed")


def route(spec: ModelSpec, logits: jax.Array):
    """Router logits [N, E] float32 -> (weights [N, k], experts [N, k] int32, probs [N, E]):
    probs are the scores normalised over all experts (softmax, or sigmoid scores over their sum)."""
    if spec.moe.router_score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, -1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, -1)
    weights, experts = jax.lax.top_k(scores, spec.moe.experts_per_token)
    if spec.moe.router_norm:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def capacity(spec: ModelSpec, group_len: int) -> int:
    """Assignments one expert takes from a group of `group_len` tokens."""
    return max(1, math.ceil(spec.moe.capacity_factor * group_len * spec.moe.experts_per_token / spec.moe.n_experts))


def _swiglu(spec: ModelSpec, x, w_gate, w_up, w_down, dot):
    dt = spec.dtype
    gate, up = dot(x, w_gate.astype(dt)), dot(x, w_up.astype(dt))
    h = (nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dt)
    return dot(h, w_down.astype(dt))


def expert_rows(spec: ModelSpec, source, index, rel, w_gate, w_up, w_down, grouped=RAGGED_DOT):
    """The rows source[index] [M, d], each for expert `rel` [M] of those held here (w_*'s leading
    axis), -> [M, d]: grouped by expert and run; rows whose expert is held elsewhere give 0."""
    held = w_gate.shape[0]
    mine = (rel >= 0) & (rel < held)
    key = jnp.where(mine, rel, held)  # rows for experts held elsewhere sort last, in no group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    dot = grouped(sizes)
    out = _swiglu(spec, jnp.take(source, index[order], axis=0), w_gate, w_up, w_down, dot)
    return jnp.zeros_like(out).at[order].set(jnp.where(mine[order][:, None], out, 0))


def dropless(spec: ModelSpec, x, weights, experts, w_gate, w_up, w_down, first=0, grouped=RAGGED_DOT):
    """x [N, d], weights/experts [N, k] -> [N, d]: every assignment to the experts held here
    (w_*'s leading axis: experts first, first + 1, ...) runs, grouped by expert; the others add 0.
    grouped: sizes -> the grouped matmul (lm.model.moe_dispatch.grouped_dot)."""
    n, k = experts.shape
    index = jnp.arange(n * k) // k
    out = expert_rows(spec, x, index, (experts - first).reshape(-1), w_gate, w_up, w_down, grouped)
    return jnp.einsum("nkd,nk->nd", out.reshape(n, k, -1).astype(jnp.float32), weights)


def _mesh_axes(rules, name: str) -> tuple:
    axes = nn.logical_to_mesh_axes((name,), rules)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def exchanged(spec: ModelSpec, x, weights, experts, w_gate, w_up, w_down, first, axes, native: bool, grouped):
    """`dropless` inside a shard_map whose devices along `axes` hold different rows and different
    experts: each assignment travels to the peer holding its expert (sorted by peer, then expert),
    runs there, and its output comes back (lm.model.moe_dispatch); assignments to experts no peer
    along `axes` holds give 0 here (another device of the `summed` axes runs them)."""
    n, k = experts.shape
    held, flat = w_gate.shape[0], experts.reshape(-1)
    firsts = jax.lax.all_gather(first, axes)  # [peers]: each peer's first expert
    peers = firsts.shape[0]
    hit = (flat[:, None] >= firsts[None]) & (flat[:, None] < firsts[None] + held)
    dest = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), peers)
    order = jnp.argsort(dest * spec.moe.n_experts + flat, stable=True)
    plan = exchange_plan(dest, peers, axes)
    room = peers * n * k  # every peer's every assignment may come here: nothing is ever dropped
    rows = ragged_exchange(jnp.take(x, order // k, axis=0), jnp.zeros((room, x.shape[1]), x.dtype), *plan, axes, native)
    ids = ragged_exchange(flat[order], jnp.full((room,), -1, jnp.int32), *plan, axes, native)
    out = expert_rows(spec, rows, jnp.arange(room), ids - first, w_gate, w_up, w_down, grouped)
    back = send_back(out, jnp.zeros((n * k, x.shape[1]), out.dtype), plan, axes, native)
    mine = jnp.zeros_like(back).at[order].set(back)  # (token, choice) order
    return jnp.einsum("nkd,nk->nd", mine.reshape(n, k, -1).astype(jnp.float32), weights)


def sharded_dropless(spec: ModelSpec, part: Partitioning, x, weights, experts, w_gate, w_up, w_down):
    """`dropless` on a mesh, per device: each device routes its own rows (no global sort);
    the experts' `embed` split (fsdp) is gathered like any FSDP weight; over the `expert` axes
    that also split rows, each assignment goes only to the shard holding its expert and its
    output comes back (`exchanged`); over `expert` axes the rows are replicated on, each shard
    runs its own experts' assignments and the outputs are summed; over the axes of the experts'
    width (`tensor`) each device runs its slice of every expert and the outputs are summed
    (Megatron's split). On TPU the experts run as megablox `gmm`."""
    batch, embed, expert, width = (_mesh_axes(part.rules, n) for n in ("batch", "embed", "expert", "expert_mlp"))
    moved = tuple(a for a in expert if a in batch)  # rows split over these: assignments exchanged
    summed = tuple(a for a in expert if a not in batch) + width  # partial outputs summed over these
    # the sequence's axes (context): each device routes the tokens of its own chunk of its rows
    length = tuple(a for a in _mesh_axes(part.rules, "length") if a not in batch and a in part.mesh.axis_names)
    held = spec.moe.n_experts // split_count(part.mesh, expert)
    rows = P(batch or None, length or None, None)
    w_in, w_out = P(expert or None, embed or None, width or None), P(expert or None, width or None, embed or None)
    manual = set(batch + length + embed + expert + width)
    backend = platform(part)
    # a Mosaic kernel (gmm) must see every mesh axis manual: only when the others have size 1
    whole = all(part.mesh.shape[a] == 1 for a in part.mesh.axis_names if a not in manual)
    grouped = grouped_kernel(backend if whole else "")
    manual = set(part.mesh.axis_names) if whole else manual

    def local(first, x, weights, experts, w_gate, w_up, w_down):
        shape = x.shape  # this device's [rows, tokens, d]: each token is routed where it is held
        x, weights, experts = (a.reshape(shape[0] * shape[1], -1) for a in (x, weights, experts))
        if embed:
            w_gate, w_up = (jax.lax.all_gather(w, embed, axis=1, tiled=True) for w in (w_gate, w_up))
            w_down = jax.lax.all_gather(w_down, embed, axis=2, tiled=True)
        ws = (w_gate, w_up, w_down)
        if moved:
            native = backend in NATIVE_EXCHANGE
            y = exchanged(spec, x, weights, experts, *ws, first[0], moved, native, grouped)
        else:
            y = dropless(spec, x, weights, experts, *ws, first[0], grouped)
        y = y.reshape(shape)
        return jax.lax.psum(y, summed) if summed else y

    run = jax.shard_map(
        local,
        mesh=part.mesh,
        in_specs=(P(expert or None), rows, rows, rows, w_in, w_in, w_out),
        out_specs=rows,
        axis_names=manual,
        check_vma=False,
    )
    firsts = jnp.arange(0, spec.moe.n_experts, held, dtype=jnp.int32)  # each expert shard's first expert
    # jitted: an eager partly-manual shard_map (e.g. an init outside jit) fails in jax 0.10
    return jax.jit(run)(firsts, x, weights, experts, w_gate, w_up, w_down)


def with_capacity(spec: ModelSpec, part: Partitioning, x, weights, experts, real, w_gate, w_up, w_down):
    """x [G, S, d], weights/experts [G, S, k], real [G, S] -> ([G, S, d], dropped assignments)."""
    g, s, k = experts.shape
    c = capacity(spec, s)
    onehot = jax.nn.one_hot(experts, spec.moe.n_experts, dtype=jnp.int32) * (real[..., None, None] > 0)  # [G, S, k, E]
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(g, k * s, spec.moe.n_experts)  # first choices first
    slot = (jnp.cumsum(by_choice, axis=1) - 1) * by_choice
    slot = slot.reshape(g, k, s, spec.moe.n_experts).transpose(0, 2, 1, 3)
    kept = (onehot > 0) & (slot < c)
    dispatch = jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=x.dtype)  # [G, S, k, E, C]; c = nowhere
    combine = jnp.einsum("gskec,gsk->gsec", dispatch.astype(jnp.float32), weights)
    dispatch = jnp.sum(dispatch, axis=2)  # [G, S, E, C]: a token goes to an expert at most once
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    xe = part.constrain(xe, ("act_expert", None, None, "act_embed"))
    dot = lambda a, w: jnp.einsum("egcd,edf->egcf", a, w, preferred_element_type=jnp.float32).astype(a.dtype)  # noqa: E731
    out = _swiglu(spec, xe, w_gate, w_up, w_down, dot)
    y = jnp.einsum("gsec,egcd->gsd", combine, out.astype(jnp.float32))
    return y, jnp.sum(onehot) - jnp.sum(kept)


def layer_stats(spec: ModelSpec, logits, probs, experts, real, dropped) -> dict:
    """Scalars of one layer over its real tokens (see the module doc)."""
    e, k = spec.moe.n_experts, spec.moe.experts_per_token
    n_real = jnp.maximum(jnp.sum(real), 1.0)
    assigned = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32) * real[:, None, None], axis=(0, 1))
    share = assigned / (n_real * k)  # f_e
    mean_prob = jnp.sum(probs * real[:, None], 0) / n_real  # P_e
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, -1)) * real) / n_real
    entropy = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.maximum(share, 1e-30)), 0.0)) / math.log(e)
    return {
        "balance": e * jnp.sum(share * mean_prob),
        "router_z": z,
        "load_min": jnp.min(share) * e,
        "load_max": jnp.max(share) * e,
        "load_entropy": entropy,
        "dropped": dropped.astype(jnp.float32),
        "assigned": n_real * k,
    }


class MoE(nn.Module):
    """The block's feed-forward as routed experts (plus an optional shared dense SwiGLU)."""

    spec: ModelSpec
    part: Partitioning

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array):
        s = self.spec
        b, t, d = x.shape
        f, e = s.moe.expert_d_ff, s.moe.n_experts
        init, out_init = normal(s.init_std), normal(s.init_std / (2 * s.n_layers) ** 0.5)
        router = param(self, "router", init, (d, e), ("embed", "router"))
        w_gate = param(self, "w_gate", init, (e, d, f), EXPERT_IN)
        w_up = param(self, "w_up", init, (e, d, f), EXPERT_IN)
        w_down = param(self, "w_down", out_init, (e, f, d), EXPERT_OUT)
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router.astype(jnp.float32))
        weights, experts, probs = route(s, logits)
        real = (segment_ids != 0).astype(jnp.float32)
        if s.moe.capacity_factor > 0:
            y, dropped = with_capacity(s, self.part, x, weights, experts, real, w_gate, w_up, w_down)
        else:
            mesh, rules = self.part.mesh, self.part.rules
            # rows the batch axes cannot split evenly (a prompt of one row on 8 devices) go the
            # partitioner's way: the whole layer's assignments sorted together
            per_device = mesh is not None and b % split_count(mesh, _mesh_axes(rules, "batch")) == 0
            if per_device:
                y = sharded_dropless(s, self.part, x, weights, experts, w_gate, w_up, w_down)
            else:
                flat = (a.reshape(b * t, -1) for a in (x, weights, experts))
                y = dropless(s, *flat, w_gate, w_up, w_down).reshape(b, t, d)
            dropped = jnp.zeros((), jnp.float32)
        y = y.astype(s.dtype)
        if s.moe.shared_d_ff:
            shared = s.replace(mlp=dict(d_ff=s.moe.shared_d_ff), use_bias=False, lora=dict(rank=0))
            y = y + Mlp(shared, self.part, name="shared")(x)
        stats = layer_stats(
            s, logits.reshape(b * t, e), probs.reshape(b * t, e), experts.reshape(b * t, -1), real.reshape(-1), dropped
        )
        return self.part.constrain(y, ("batch", "length", "act_embed")), stats


def aux_sums(spec: ModelSpec, stats: dict, count) -> tuple[jax.Array, dict]:
    """The scan's per-layer stats ({name: [n_layers]}) -> (the term to add to a loss's objective
    sum, the sums to add to its statistics). Every term is a per-layer mean weighted by the
    loss's own `count`, so after the step divides by the global count it is the count-weighted
    mean over micro-batches (within one micro-batch the statistics are over all devices' rows)."""
    balance, z = jnp.mean(stats["balance"]), jnp.mean(stats["router_z"])
    objective = count * (spec.moe.balance_coef * balance + spec.moe.z_coef * z)
    sums = {
        "moe_balance_sum": count * balance,
        "moe_router_z_sum": count * z,
        "moe_dropped_sum": count * jnp.sum(stats["dropped"]) / jnp.maximum(jnp.sum(stats["assigned"]), 1.0),
        "moe_dropped_assignments_total": jnp.sum(stats["dropped"]),
    }
    for name in ("load_min", "load_max", "load_entropy"):
        for i in range(stats[name].shape[0]):
            sums[f"moe_{name}_l{i}_sum"] = count * stats[name][i]
    return objective, sums
