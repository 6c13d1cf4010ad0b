"""A pipeline that runs the loss on its last stage, so backwards start before every forward is
done: the 1F1B and interleaved 1F1B schedules (model.pipeline_schedule="1f1b").

Autodiff of the all-forward loop (lm.model.pipeline) can only start backward passes once the
whole batch went through, so each stage keeps every micro-batch's activations. Here one loop
runs a schedule's table (lm.model.pipeline_schedule): at each time unit each stage runs a
forward or a backward of one chunk of layers, or idles, and passes its output on (activations
to the next stage, gradients to the previous one) by collective permutes. The stages branch for
real: the loop runs under `shard_map` over the `stage` axis (the other mesh axes stay
automatic), so each device runs only its own action.

A stage keeps the input of each micro-batch in flight and the gradient that came back for it;
its backward recomputes the chunk's forward (remat'd per layer as the model says) and
differentiates it. The last chunk's forward also runs the head and the loss of its
micro-batch and keeps the loss's gradient for the backward. The loop therefore computes the
loss and its gradients together: a custom VJP returns them, scaled by the incoming
cotangent. Without differentiation (an evaluation) the same loop runs forwards only.

The loss must add up over micro-batches: `head_loss(logits, micro_batch) -> (objective_sum,
sums)`, as every LossFn does over gradient accumulation's micro-batches.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.errors import UserError
from lm.model.pipeline import batch_shards, by_stage, check, microbatches, split_micro, stage_fn, stages_of
from lm.model.pipeline_schedule import FORWARD, simulate
from lm.model.transformer import REMAT_POLICIES, Block


def runs_loss(model) -> bool:
    """Whether a model's training loss runs inside its pipeline (a 1F1B schedule on a stage mesh)."""
    spec, part = getattr(model, "spec", None), getattr(model, "part", None)
    return spec is not None and part is not None and spec.pipeline.schedule == "1f1b" and stages_of(part) > 1


@functools.cache
def _tables(kind: str, stages: int, micro: int, repeats: int, forward_only: bool):
    sched = simulate(kind, stages, micro, repeats)
    n = sched.units
    if forward_only:  # the all-forward schedule's forward units
        n = int((sched.op == FORWARD).any(axis=1).nonzero()[0].max()) + 1
    cols = (sched.op, sched.mb, sched.rnd, sched.x_slot, sched.g_slot, sched.recv_x, sched.recv_g)
    return tuple(c[:n] for c in cols), sched.x_slots, sched.g_slots


def pipelined_loss(model, params, batch: dict, rng, head_loss, group: int = 1, output: str = "logits"):
    """(objective_sum, sums) of `head_loss(out, micro-batch)` over the pipeline's micro-batches of
    `batch` (row fields [N, ...]), `out` the model's `output` of the micro-batch (its logits, or a
    reward model's scores: "scalar"), with the model's blocks run by the 1F1B schedule; gradients
    flow to every param. `group`: consecutive rows that must share a micro-batch, in order (2 for
    a preference pair's chosen and rejected rows)."""
    spec, part = model.spec, model.part
    stages, repeats = stages_of(part), spec.pipeline.repeats
    m = microbatches(spec, stages)
    check(spec, stages, batch["inputs"].shape[0] // group, batch_shards(part))
    split = functools.partial(_split_groups, m=m, group=group)
    if spec.lora.dropout > 0 and rng is not None:
        raise UserError("model.pipeline_schedule=1f1b does not run LoRA dropout: set model.lora_dropout=0")
    x, rope, local = model.apply(
        {"params": params}, batch["inputs"], batch["segment_ids"], batch["positions"], output="embedded"
    )
    axes = nn.logical_to_mesh_axes(("stage",), part.rules)[0]
    layers = jax.tree.map(lambda a: by_stage(a, stages, repeats, part, axes), (params["blocks"], local))
    tail_params = {k: v for k, v in params.items() if k != "blocks"}
    side = jax.tree.map(split, (batch, rope))
    policy = REMAT_POLICIES.get(spec.remat)
    stage = stage_fn(Block(spec, part, parent=None), policy)

    def tail(tp, h, mb):
        out = model.apply({"params": tp}, mb["inputs"], mb["segment_ids"], mb["positions"], hidden=h, output=output)
        return head_loss(out, mb)

    run = functools.partial(_run, stage, tail, part, axes, (stages, m, repeats))

    @jax.custom_vjp
    def loss(blocks, tp, xs):
        return run(blocks, layers[1], tp, xs, side, False)[0]

    def fwd(blocks, tp, xs):
        return run(blocks, layers[1], tp, xs, side, True)

    def bwd(grads, ct):
        g = ct[0]
        return jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)

    loss.defvjp(fwd, bwd)
    return loss(layers[0], tail_params, split(x))


def _split_groups(a, m: int, group: int):
    """[N, ...] -> [m, N/m, ...] as `split_micro` does, by groups of `group` consecutive rows."""
    a = jnp.asarray(a)
    grouped = split_micro(a.reshape(a.shape[0] // group, group, *a.shape[1:]), m)
    return grouped.reshape(m, -1, *a.shape[1:])


def _run(stage, tail, part, axes, shape, blocks, flags, tail_params, xs, side, grads: bool):
    """((objective_sum, sums), (d blocks [S, R, chunk, ...], d tail params, d xs)); None for the
    gradients without `grads`."""
    stages, m, repeats = shape
    tables, x_slots, g_slots = _tables("1f1b" if grads else "gpipe", stages, m, repeats, not grads)
    mbs, rope = side
    out_shape = jax.eval_shape(tail, tail_params, xs[0], jax.tree.map(lambda a: a[0], mbs))
    manual = set((axes,) if isinstance(axes, str) else axes)

    def body(blocks, flags, tail_params, xs, mbs, rope):
        me = jax.lax.axis_index(axes)
        chunks = jax.tree.map(lambda a: a[0], (blocks, flags))  # [R, chunk, ...]: this stage's
        zero = jnp.zeros_like(xs[0])
        carry = dict(
            xbuf=jnp.zeros((x_slots, *xs.shape[1:]), xs.dtype),
            gbuf=jnp.zeros((g_slots, *xs.shape[1:]), xs.dtype),
            value=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape),
        )
        if grads:
            carry |= dict(
                d_chunks=jax.tree.map(jnp.zeros_like, chunks[0]),
                d_tail=jax.tree.map(jnp.zeros_like, tail_params),
                d_xs=jnp.zeros_like(xs),
            )

        def inputs(c, j, r, x_slot):
            x = jnp.where(x_slot < 0, xs[j], c["xbuf"][jnp.maximum(x_slot, 0)])
            here = jax.tree.map(lambda a: a[r], chunks)
            mb_side = jax.tree.map(lambda a: a[j], (mbs["segment_ids"], rope))
            return here, x, mb_side

        def forward(c, j, r, x_slot, g_slot):
            here, x, (seg, rp) = inputs(c, j, r, x_slot)
            y = stage(here, x, seg, rp, None)
            mb = jax.tree.map(lambda a: a[j], mbs)

            def last(c):
                if not grads:
                    return c | dict(value=_add(c["value"], tail(tail_params, y, mb)))
                (obj, sums), (dt, dy) = jax.value_and_grad(tail, argnums=(0, 1), has_aux=True)(tail_params, y, mb)
                gbuf = jax.lax.dynamic_update_index_in_dim(c["gbuf"], dy.astype(xs.dtype), g_slot, 0)
                return c | dict(value=_add(c["value"], (obj, sums)), d_tail=_add(c["d_tail"], dt), gbuf=gbuf)

            c = jax.lax.cond((me == stages - 1) & (r == repeats - 1), last, lambda c: c, c)
            return c, y, zero

        def backward(c, j, r, x_slot, g_slot):
            here, x, (seg, rp) = inputs(c, j, r, x_slot)
            _, vjp = jax.vjp(lambda p, a: stage((p, here[1]), a, seg, rp, None), here[0], x)
            dp, dx = vjp(c["gbuf"][g_slot])
            d_chunks = jax.tree.map(lambda acc, d: acc.at[r].add(d.astype(acc.dtype)), c["d_chunks"], dp)
            first = (me == 0) & (r == 0)
            d_xs = jax.lax.dynamic_update_index_in_dim(c["d_xs"], jnp.where(first, dx, c["d_xs"][j]), j, 0)
            return c | dict(d_chunks=d_chunks, d_xs=d_xs), zero, dx

        def idle(c, *_):
            return c, zero, zero

        act = ("batch", "length", "act_embed")

        def pinned(branch):  # every branch's outputs in one sharding: XLA requires it of a conditional
            def run(*args):
                c, send_x, send_g = branch(*args)
                bufs = {k: part.constrain(c[k], (None, *act)) for k in ("xbuf", "gbuf", "d_xs") if k in c}
                return c | bufs, part.constrain(send_x, act), part.constrain(send_g, act)

            return run

        branches = tuple(pinned(b) for b in (idle, forward, backward)[: 3 if grads else 2])

        def unit(c, row):
            op, j, r, x_slot, g_slot, recv_x, recv_g = (t[me] for t in row)
            c, send_x, send_g = jax.lax.switch(op, branches, c, j, r, x_slot, g_slot)
            got_x = jax.lax.ppermute(send_x, axes, [(i, (i + 1) % stages) for i in range(stages)])
            c = c | dict(xbuf=_keep(c["xbuf"], got_x, recv_x))
            if grads:
                got_g = jax.lax.ppermute(send_g, axes, [(i, (i - 1) % stages) for i in range(stages)])
                c = c | dict(gbuf=_keep(c["gbuf"], got_g, recv_g))
            return c, None

        c, _ = jax.lax.scan(unit, carry, tuple(jnp.asarray(t) for t in tables))
        value = jax.lax.psum(c["value"], axes)
        if not grads:
            return value
        d = jax.lax.psum((c["d_tail"], c["d_xs"]), axes)
        return value, jax.tree.map(lambda a: a[None], c["d_chunks"]), *d

    per_stage, same = P(axes), P()
    out_specs = same if not grads else (same, per_stage, same, same)
    result = jax.shard_map(
        body,
        mesh=part.mesh,
        in_specs=(per_stage, per_stage, same, same, same, same),
        out_specs=out_specs,
        axis_names=manual,
        check_vma=False,
    )(blocks, flags, tail_params, xs, mbs, rope)
    if not grads:
        return result, None
    value, d_blocks, d_tail, d_xs = result
    return value, (d_blocks, d_tail, d_xs)


def _add(a, b):
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def _keep(buf, got, slot):
    """buf with `got` in `slot` (unchanged for slot -1)."""
    i = jnp.maximum(slot, 0)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, got, buf[i]), i, 0)
