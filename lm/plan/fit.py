"""`lm plan --fit`: the first setting under which a step fits the target's memory.

Candidates vary the remat policy (the config's, or one that keeps less), the micro-batch count
(the config's, doubled while every device keeps at least one row) and the mesh (data x fsdp x
context x tensor: tensor a power of two whose splits divide every param; context a power of two
splitting data.seq_len into whole chunks, 2 x context for model.context_attention=ring). They are
ranked by how little they change: the config's own context size first (a new context size only
when no setting without one fits: the split attention runs no fused kernel and keeps T/context x T
scores), then fewest settings changed, fewest micro-batches, lightest remat, least context and
tensor parallelism (the fastest first); the planner screens them, and the first that it says fits
with a margin is compiled to confirm. A refusal by the compiler moves on to the next one.
"""

from __future__ import annotations

import itertools

from lm.config import Config, rules_table, with_values
from lm.errors import UserError
from lm.model.spec import ModelSpec
from lm.plan.hardware import Target
from lm.plan.memory import estimate, mesh_sizes, param_leaves, splits
from lm.train.registry import compiled_step

REMAT_ORDER = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")  # keeps less ->
MARGIN = 0.92  # the planner's estimate must leave this share of HBM unused (its error is within 15%)
MAX_COMPILES = 3
MESH_KEYS = ("data", "fsdp", "context", "tensor")  # what the search sets (stage and expert are the config's)


def _setting(config, remat: str, micro: int, mesh: dict) -> Config:
    return with_values(
        config,
        {"model.remat": remat, "train.micro_batches": micro} | {f"mesh.{k}": v for k, v in mesh.items()},
    )


def contexts(config, chips: int) -> list[int]:
    """Context sizes to try: the config's first, then every power of two that divides the chips
    and splits the sequence into whole chunks (2 x context of them for the ring)."""
    own = mesh_sizes(config, chips)["context"]
    chunks = 2 if config.model.context_attention == "ring" else 1
    out, size = [own], 1
    while size <= chips:
        if chips % size == 0 and config.data.seq_len % (size * chunks) == 0 and size != own:
            out.append(size)
        size *= 2
    return out


def _meshes(config, chips: int) -> list[dict]:
    """The config's mesh first, then data=1 with fsdp x context x tensor over every chip (tensor
    <= 16; the config's stage and expert sizes kept)."""
    own = mesh_sizes(config, chips)
    rest = own["stage"] * own["expert"]
    spec = ModelSpec.from_config(config.model)
    leaves = param_leaves(spec.replace(attention=dict(kernel="xla"), kernels="plain"))
    rules = dict(rules_table(config))
    out = [own]
    if chips % rest:
        return out
    for context, tensor in itertools.product(contexts(config, chips), (1, 2, 4, 8, 16)):
        if (chips // rest) % (context * tensor):
            continue
        mesh = own | {"data": 1, "fsdp": chips // rest // context // tensor, "context": context, "tensor": tensor}
        if all(_divides(leaf, rules, mesh) for leaf in leaves) and mesh != own:
            out.append(mesh)
    return out


def _divides(leaf, rules, mesh) -> bool:
    return all(dim % splits((name,), rules, mesh) == 0 for dim, name in zip(leaf.shape, leaf.names))


def candidates(config, step: str, chips: int) -> list[Config]:
    """Every setting to try, in the order of the module doc."""
    t, remat = config.train, config.model.remat
    remats = REMAT_ORDER[REMAT_ORDER.index(remat) :] if remat in REMAT_ORDER else (remat,)
    micros = [t.micro_batches]
    while t.batch_size % (micros[-1] * 2) == 0:
        micros.append(micros[-1] * 2)
    rules = dict(rules_table(config))  # the search changes sizes, never the rule table
    splits_batch = compiled_step(step).splits_batch
    found = []
    meshes = _meshes(config, chips)
    for r, m, mesh in itertools.product(remats, micros, meshes):
        if splits_batch and (t.batch_size // m) % splits(("batch",), rules, mesh):
            continue  # every device must keep a whole number of rows
        changed = (r != remat) + (m != t.micro_batches) + (mesh != meshes[0])
        rank = REMAT_ORDER.index(r) if r in REMAT_ORDER else 0
        key = (mesh["context"] != meshes[0]["context"], changed, m, rank, mesh["context"], mesh["tensor"])
        found.append((key, r, m, mesh))
    found.sort(key=lambda x: x[0])
    return [_setting(config, r, m, mesh) for _, r, m, mesh in found]


def overrides(config) -> str:
    """The found setting as `lm train` / `lm plan` flags."""
    settings = {"model.remat": config.model.remat, "train.micro_batches": config.train.micro_batches}
    settings |= {f"mesh.{k}": config.mesh[k] for k in MESH_KEYS}
    return " ".join(f"--config.{k}={v}" for k, v in settings.items())


def search(config, step: str, target: Target, devices):
    """(config, estimate, compiled or None) of the first candidate that fits (compiled to confirm
    when `devices` are given), or (None, None, compiles tried)."""
    from lm.plan.aot import compile_step

    compiles = 0
    for c in candidates(config, step, target.chips):
        try:
            est = estimate(c, step, target.chips, chip=target.chip)
        except UserError:  # a batch this setting cannot split
            continue
        if est.total > MARGIN * target.hbm_bytes:
            continue
        compiled = compile_step(step, c, devices) if devices is not None else None
        compiles += compiled is not None
        if compiled is None or not compiled.error and compiled.total <= target.hbm_bytes:
            return c, est, compiled
        if compiles >= MAX_COMPILES:
            break
    return None, None, compiles
