"""The update direction (AdamW, or Muon for the blocks' matrices and AdamW for the rest), the
learning-rate schedule (warmup + cosine, or warmup-stable-decay), clipping and a weight-decay mask.

The learning rate is not inside the optax chain: the train step multiplies the direction by
`schedule(state.step)`. One counter (the state's step) then drives both the applied and the
logged learning rate, and a skipped (non-finite) step still advances the schedule, so a run
with skipped steps ends its schedule on time. Adam's own count (bias correction) counts the
moment updates actually made, which is what the correction is for.

Muon (optim.optimizer=muon) orthogonalises each matrix's Nesterov momentum by Newton-Schulz
(optax.contrib.scale_by_muon). A scanned block's weight is [layers, ..., fan_in..., fan_out...]:
every axis before its contracting ones (layers, experts, pipeline stages) is a batch of matrices,
each orthogonalised on its own; optax's own `muon` would send such a 3-D param to Adam. The
matrices' rate is optim.muon_lr on the same schedule: their direction is scaled by muon_lr / lr.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from lm.model.quant import BASE_WEIGHTS, CONTRACTING


def make_schedule(o, total_steps: int) -> optax.Schedule:
    """Warmup from 0 to o.lr over o.warmup_steps, then cosine to lr * min_lr_ratio at the span's
    end (span: o.decay_steps or total_steps), or for o.schedule 'wsd' lr held until the last
    decay_fraction of the span and decay_shape down to lr * min_lr_ratio."""
    span = o.decay_steps or total_steps
    end = o.lr * o.min_lr_ratio
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
            decay_steps=max(span, o.warmup_steps + 1), end_value=end,
        )  # fmt: skip
    start = max(span - max(round(o.decay_fraction * span), 1), o.warmup_steps)
    length = max(span - start, 1)
    shape = _DECAY_SHAPES[o.decay_shape]

    def wsd(step):
        t = jnp.asarray(step, jnp.float32)
        warm = o.lr * t / max(o.warmup_steps, 1)
        progress = jnp.clip((t - start) / length, 0.0, 1.0)
        decayed = end + (o.lr - end) * shape(progress)
        return jnp.where(t < o.warmup_steps, warm, jnp.where(t < start, o.lr, decayed))

    return wsd


_DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + jnp.cos(jnp.pi * p)),
    "1-sqrt": lambda p: 1.0 - jnp.sqrt(p),
}


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


def muon_dims(path, leaf) -> MuonDimensionNumbers | None:
    """How Muon sees a param as matrices: its contracting axes (fan in), the axes after them (fan
    out), every axis before them a batch; None for a param AdamW trains: all but the blocks' layer
    weights (embeddings, head, norms, biases, a MoE router, LoRA adapters)."""
    if path[-1].key not in BASE_WEIGHTS or leaf.ndim < 2:
        return None
    first, count = CONTRACTING[path[-1].key]
    reduction = tuple(range(leaf.ndim + first, leaf.ndim + first + count))
    return MuonDimensionNumbers(reduction, tuple(range(reduction[-1] + 1, leaf.ndim)))


def _dims_tree(tree):
    return jax.tree_util.tree_map_with_path(muon_dims, tree)


def _labels(params):
    return jax.tree_util.tree_map_with_path(lambda p, x: "adam" if muon_dims(p, x) is None else "muon", params)


def _shape_scale(o) -> optax.GradientTransformation:
    """Scales each orthogonalised update: sqrt(max(1, fan_out / fan_in)) (Keller Jordan's width
    rule), or with o.muon_rms > 0 that RMS times sqrt(max(fan_in, fan_out)) (Moonlight's rule)."""

    def scale(path, u):
        dims = muon_dims(path, u)
        fan_in = math.prod(u.shape[a] for a in dims.reduction_axis)
        fan_out = math.prod(u.shape[a] for a in dims.output_axis)
        factor = o.muon_rms * max(fan_in, fan_out) ** 0.5 if o.muon_rms > 0 else max(1.0, fan_out / fan_in) ** 0.5
        return u * factor

    return optax.GradientTransformation(
        optax.init_empty_state, lambda u, s, p=None: (jax.tree_util.tree_map_with_path(scale, u), s)
    )


def make_optimizer(o, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(direction, schedule): the step applies `-schedule(step) * direction(grads)`.

    AdamW: clipped gradients -> Adam -> + weight_decay * param, exactly optax.adamw with that
    schedule. Muon: the same for embeddings, head, norms and biases; the blocks' matrices get
    (orthogonalised momentum x shape scale + weight_decay * param) x muon_lr / lr.
    """
    clip = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    adamw = [
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=lambda p: decay_mask(p, o)),
    ]
    if o.optimizer == "adamw":
        return optax.chain(*clip, *adamw), make_schedule(o, total_steps)
    muon = optax.chain(
        scale_by_muon(
            ns_steps=o.muon_ns_steps, beta=o.muon_momentum, nesterov=True, weight_dimension_numbers=_dims_tree
        ),
        _shape_scale(o),
        optax.add_decayed_weights(o.weight_decay),
        optax.scale(o.muon_lr / o.lr),
    )
    split = optax.partition({"muon": muon, "adam": optax.chain(*adamw)}, _labels)
    return optax.chain(*clip, split), make_schedule(o, total_steps)


def apply_update(params, direction, lr):
    """params - lr * direction, in each param's dtype."""
    return jax.tree.map(lambda p, d: (p - lr * d).astype(p.dtype), params, direction)
