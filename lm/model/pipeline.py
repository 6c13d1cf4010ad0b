"""Pipeline parallelism: the scanned blocks run as stages over the mesh's `stage` axis.

Active when the model's mesh has stage > 1 and it is not decoding (decoding runs the plain
layer scan, each layer's params gathered from its stage). The params keep their checkpoint
layout [n_layers, ...] (a checkpoint does not depend on the mesh); the "layers" rule splits
them contiguously over the stages, and only this forward views them per stage.

Schedule. The batch's rows split into M micro-batches (interleaved like gradient
accumulation's, so no row leaves its device). A buffer [stages, rows / M, T, D], sharded over
`stage` on axis 0, holds what each stage works on. Each of the M * repeats + stages - 1
iterations runs every stage's chunk of layers on its slot at once (a vmap over the stage
axis), collects the last stage's output, shifts the buffer one stage on (a collective
permute) and feeds the next micro-batch into stage 0. Per-row side inputs (segment ids, RoPE
tables) are picked per stage by the micro-batch it holds; per-layer ones (local flags) travel
with the layers.

GPipe (repeats = 1): stage s holds layers [s * L/S, (s+1) * L/S), the checkpoint layout as it
is sharded. Circular (repeats = r > 1, as in MaxText): stage s runs chunks s, s + S, s + 2S, ...
of L / (S r) layers each, so a micro-batch passes the stages r times; the [r, S, chunk]
view of the params is NOT how the "layers" rule lays them out, so every forward reshards the
block params (an all-to-all; the backward sends their gradients back) and holds that copy
until the backward pass is done. A micro-batch leaving the last stage waits in the store for
its next round, so circular needs M >= stages.

Schedules (model.pipeline_schedule): this loop is "gpipe" (circular with repeats > 1); "1f1b"
runs the loss inside the pipeline (lm.model.pipeline_1f1b) and only evaluations run this loop.

Mixture-of-experts blocks are refused for now: their routing statistics (the scan's aux)
would have to be collected per micro-batch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from lm.errors import UserError
from lm.sharding import split_count


def stages_of(part) -> int:
    """Pipeline stages of a Partitioning's mesh (1 without a mesh or a stage axis)."""
    return 1 if part.mesh is None else dict(part.mesh.shape).get("stage", 1)


def microbatches(spec, stages: int) -> int:
    """The pipeline's micro-batches: model.pipeline_microbatches, 0 meaning one per stage."""
    return spec.pipeline.microbatches or stages


def bubble_fraction(stages: int, microbatches: int = 0, repeats: int = 1) -> float:
    """Share of stage-iterations that idle: (S - 1) / (repeats * M + S - 1); M = 0 means S."""
    m = microbatches or stages
    return (stages - 1) / (repeats * m + stages - 1)


def stage_layers(n_layers: int, stages: int, repeats: int = 1) -> list[list[int]]:
    """The layers each stage runs, in the order it runs them (chunk after chunk)."""
    chunk = n_layers // (stages * repeats)
    return [[(r * stages + s) * chunk + j for r in range(repeats) for j in range(chunk)] for s in range(stages)]


def stage_block_bytes(block_bytes: int, stages: int, repeats: int = 1) -> int:
    """Bytes of the stacked block params a device holds in a pipeline, from their unsplit
    size (before fsdp/tensor splits): 1/stages of them, and as much again for circular's
    resharded copy, alive from the forward to the end of the backward."""
    return block_bytes // stages * (2 if repeats > 1 else 1)


def is_pipelined(part, decode: bool) -> bool:
    """Whether the decoder's blocks run as a pipeline: a stage > 1 mesh, and not decoding."""
    return stages_of(part) > 1 and not decode


def batch_shards(part) -> int:
    """How many ways the rule table splits the batch axis on the mesh."""
    return split_count(part.mesh, nn.logical_to_mesh_axes(("batch",), part.rules)[0])


def check(spec, stages: int, rows: int, shards: int = 1) -> None:
    """UserError unless `rows` batch rows can run through a pipeline of `stages`."""
    r, m = spec.pipeline.repeats, microbatches(spec, stages)
    if spec.moe.n_experts:
        raise UserError(
            f"mixture-of-experts layers (model.n_experts={spec.moe.n_experts}) cannot be pipelined yet: "
            f"set mesh.stage=1 (it is {stages})"
        )
    if spec.n_layers % (stages * r):
        raise UserError(
            f"model.n_layers={spec.n_layers} must split into mesh.stage={stages} x "
            f"model.pipeline_repeats={r} equal chunks"
        )
    if r > 1 and m < stages:
        raise UserError(
            f"model.pipeline_microbatches={m}: a circular pipeline (model.pipeline_repeats={r}) "
            f"needs at least mesh.stage={stages} micro-batches"
        )
    if rows % m or (rows // m) % shards:
        raise UserError(
            f"a batch of {rows} rows in model.pipeline_microbatches={m} micro-batches: each must "
            f"hold the same number of rows, divisible by the {shards} batch shards"
        )


def split_micro(a, m):
    """[B, ...] -> [m, B/m, ...], micro-batch i holding rows i, i+m, ... (stays on its devices)."""
    return jnp.asarray(a).reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def merge_micro(a):
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def by_stage(a, stages, repeats, part, axes):
    """[L, ...] -> [S, R, L/(S R), ...], split over the stage axis (a reshard when R > 1)."""
    a = a.reshape(repeats, stages, a.shape[0] // (stages * repeats), *a.shape[1:]).swapaxes(0, 1)
    if part.mesh is None:
        return a
    rest = (PartitionSpec.UNCONSTRAINED,) * (a.ndim - 3)
    return jax.lax.with_sharding_constraint(a, NamedSharding(part.mesh, PartitionSpec(axes, None, None, *rest)))


def stage_fn(block, policy):
    """One stage: its chunk of layers scanned over `x`, each layer remat'd like the model's."""

    def stage(layers, x, seg, rope, key):
        def layer(x, xs):
            params, flag, j = xs
            rngs = {} if key is None else {"dropout": jax.random.fold_in(key, j)}
            return block.apply({"params": params}, x, seg, rope, None, None, flag, rngs=rngs)[0], None

        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        params, flags = layers
        return jax.lax.scan(layer, x, (params, flags, jnp.arange(jax.tree.leaves(params)[0].shape[0])))[0]

    return stage


def pipeline_blocks(module: nn.Module, block_cls, policy, x, segment_ids, rope_cs, local):
    """The 'blocks' of `module` (a decoder holding stacked params [n_layers, ...] under that
    name) run as a pipeline over x [B, T, D]; returns the blocks' output [B, T, D].

    block_cls(spec, part) is one layer (returning (x, aux)); policy: its remat policy or None.
    """
    spec, part = module.spec, module.part
    stages, repeats = stages_of(part), spec.pipeline.repeats
    m = microbatches(spec, stages)
    check(spec, stages, x.shape[0], batch_shards(part))
    axes = nn.logical_to_mesh_axes(("stage",), part.rules)[0]
    c = part.constrain
    layers = (nn.unbox(module.variables["params"]["blocks"]), local)
    layers = jax.tree.map(lambda a: by_stage(a, stages, repeats, part, axes), layers)
    seg_rope = jax.tree.map(lambda a: split_micro(a, m), (segment_ids, rope_cs))
    # the micro-batches' inputs, then each round's outputs; every stage holds a copy (the last
    # stage's output is sent to all each iteration), so stage 0 reads its next input locally
    store = c(split_micro(x, m), (None, "batch", "length", "act_embed"))
    key = module.make_rng("dropout") if module.has_rng("dropout") else None
    stage = jax.vmap(stage_fn(block_cls(spec, part, parent=None), policy), spmd_axis_name=axes)
    ids = jnp.arange(stages)
    first = (ids == 0)[:, None, None, None]

    def per_stage(a):  # [S, rows, ...] with rows over the batch axes
        return c(a, ("stage", "batch") + (None,) * (a.ndim - 2))

    def step(carry, i):
        buf, store = carry
        buf = per_stage(jnp.where(first, store[i % m][None], buf))
        k = i - ids  # the micro-batch round each stage holds (bubble where < 0 or >= m * repeats)
        rnd = jnp.clip(k // m, 0, repeats - 1)
        here = (
            jax.tree.map(lambda a: jax.vmap(lambda s, r: s[r])(a, rnd), layers)
            if repeats > 1
            else jax.tree.map(lambda a: a[:, 0], layers)
        )
        seg, rope = jax.tree.map(lambda a: per_stage(a[k % m]), seg_rope)
        keys = None if key is None else jax.vmap(lambda s: jax.random.fold_in(key, s))(i * stages + ids)
        out = per_stage(stage(here, buf, seg, rope, keys))
        done = i - (stages - 1)  # the round leaving the last stage
        slot = done % m
        valid = (done >= 0) & (done < m * repeats)
        store = jax.lax.dynamic_update_index_in_dim(store, jnp.where(valid, out[-1], store[slot]), slot, 0)
        return (per_stage(jnp.roll(out, 1, axis=0)), store), None

    buf = per_stage(jnp.zeros((stages, *store.shape[1:]), store.dtype))
    (_, store), _ = jax.lax.scan(step, (buf, store), jnp.arange(m * repeats + stages - 1))
    out = c(merge_micro(store), ("batch", "length", "act_embed"))
    return _forward_only(out) if spec.pipeline.schedule == "1f1b" else out


@jax.custom_vjp
def _forward_only(x):
    """x; differentiating it is refused: a 1F1B schedule's gradients come from the loss it runs
    (lm.model.pipeline_1f1b), and autodiff here would silently hold every micro-batch."""
    return x


def _refuse(x):
    raise UserError(
        "model.pipeline_schedule=1f1b runs the pretraining and SFT losses inside the pipeline; "
        "this stage's loss differentiates the plain forward: set model.pipeline_schedule=gpipe"
    )


_forward_only.defvjp(_refuse, lambda _, g: (g,))
