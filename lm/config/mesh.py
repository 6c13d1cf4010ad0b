"""The `mesh` section: device mesh axis sizes and the logical-axis rule table.

Axes, outermost first: `data` (replicas), `stage` (pipeline stages, lm.model.pipeline), `fsdp`
(params and rows split), `expert` (mixture-of-experts weights split by expert, rows split for
the rest of the model), `context` (the sequence of every activation split: long sequences; the
model's attention gathers or passes keys and values over it, lm.model.ring_attention), `tensor`
(heads and hidden units split; innermost, the fastest links).

The rule table lives here, not beside the sharding code, because a config must load without jax.
"""

from __future__ import annotations

from lm.config.core import require

AXES = ("data", "stage", "fsdp", "expert", "context", "tensor")

# Logical axis -> mesh axes. ONE table; a config may override entries via mesh.rules.
DEFAULT_RULES = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),  # a no-op unless mesh.context > 1
    "cache_length": (),
    "cache_pool": (),  # the paged KV pool's token rows (lm.model.paged): shared by all sequences
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_expert": ("expert",),  # a mixture-of-experts layer's tokens grouped by expert
    # params
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": ("stage",),  # a no-op unless mesh.stage > 1: then each stage holds its layers
    "stage": ("stage",),  # the pipeline's leading axis of the stacked layers and its buffers
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "router": (),
    "lora_rank": (),
    "position": (),
    "norm": (),
}

# an axis of -1 takes whatever devices the others leave
DEFAULTS = dict(data=-1, stage=1, fsdp=1, expert=1, context=1, tensor=1, rules=dict(DEFAULT_RULES))


def rules_table(c) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The logical-axis rule table as the hashable sequence flax expects."""
    return tuple((name, tuple(axes) if axes else None) for name, axes in sorted(c.mesh.rules.items()))


def check(c) -> None:
    for axis in AXES:
        require(
            c.mesh[axis] == -1 or c.mesh[axis] > 0,
            f"mesh.{axis}",
            c.mesh[axis],
            "expected a positive size or -1 (whatever devices are left)",
        )
    require(sum(c.mesh[a] == -1 for a in AXES) <= 1, "mesh", c.mesh.to_dict(), "at most one axis may be -1")
    for name, axes in c.mesh.rules.items():
        for axis in axes:
            require(axis in AXES, f"mesh.rules.{name}", axes, f"expected mesh axes among {', '.join(AXES)}")
