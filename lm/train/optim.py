"""AdamW's update direction, the warmup + cosine schedule, clipping and a weight-decay mask.

The learning rate is not inside the optax chain: the train step multiplies the direction by
`schedule(state.step)`. One counter (the state's step) then drives both the applied and the
logged learning rate, and a skipped (non-finite) step still advances the schedule, so a run
with skipped steps ends its schedule on time. Adam's own count (bias correction) counts the
moment updates actually made, which is what the correction is for.
"""

from __future__ import annotations

import jax
import optax


def make_schedule(o, total_steps: int) -> optax.Schedule:
    decay_steps = o.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(decay_steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def _kind(path) -> str:
    """Classifies a param by its name: 'embedding', 'norm_or_bias' or 'matrix'."""
    name = path[-1].key
    if name in ("embedding", "pos_embedding"):
        return "embedding"
    if name in ("scale", "bias") or name.endswith("_bias"):
        return "norm_or_bias"
    return "matrix"  # by name, not ndim: scanned norms are 2-D [layers, d]


def decay_mask(params, o):
    """True where weight decay applies: matrices always; embeddings, norms and biases if configured."""
    allowed = {"matrix": True, "embedding": o.decay_embeddings, "norm_or_bias": o.decay_norms_and_biases}
    return jax.tree_util.tree_map_with_path(lambda p, _: allowed[_kind(p)], params)


def make_optimizer(o, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(direction, schedule): the step applies `-schedule(step) * direction(grads)`.

    The direction is AdamW's (clipped gradients -> Adam -> + weight_decay * param), so the
    result is exactly optax.adamw with that schedule.
    """
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    parts += [
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=lambda p: decay_mask(p, o)),
    ]
    return optax.chain(*parts), make_schedule(o, total_steps)


def apply_update(params, direction, lr):
    """params - lr * direction, in each param's dtype."""
    return jax.tree.map(lambda p, d: (p - lr * d).astype(p.dtype), params, direction)
