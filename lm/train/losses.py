"""Losses as (sum, count) pairs so that averages over micro-batches and devices are exact.

A LossFn is `(params, batch, frozen, rng) -> (objective_sum, sums)`: params are the trained
model's (its frozen base merged in), frozen maps names to the other frozen models
(lm.model.build.FrozenModel: a reference, a teacher), rng is None when evaluating. The gradient
is taken of `objective_sum`, and `sums` holds additive statistics including the token `count`.
The train step divides by the global count once, after all micro-batches. Every loss of a trained
model adds the model's auxiliary terms (mixture-of-experts routing: lm.model.apply.add_aux),
weighted by its own count.
"""

from __future__ import annotations

import jax.numpy as jnp

from lm.model.apply import add_aux, forward, target_logprobs
from lm.model.pipeline_1f1b import pipelined_loss, runs_loss


def masked_cross_entropy(logits, targets, mask):
    """Returns (nll_sum, count, z_sum): summed over positions where mask is 1.

    logits are float32 [B, T, V]; z_sum is the sum of log(Z)^2 for the PaLM z-loss.
    """
    logp, log_z = target_logprobs(logits, targets)
    mask = mask.astype(jnp.float32)
    # where, not just * mask: an out-of-range target id (e.g. a padding sentinel) gathers NaN
    nll_sum = jnp.sum(jnp.where(mask != 0, -logp * mask, 0.0))
    return nll_sum, jnp.sum(mask), jnp.sum(jnp.square(log_z) * mask)


def pretrain_loss(model, z_loss: float = 0.0):
    """Next-token cross-entropy on every position whose loss_mask is 1, plus optional z-loss (and
    the model's auxiliary losses: lm.model.apply.add_aux). A 1F1B pipeline runs it per
    micro-batch on its last stage (lm.model.pipeline_1f1b)."""

    def head_loss(logits, batch):
        nll, count, z = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])
        return nll + z_loss * z, {"loss_sum": nll, "log_z_sq_sum": z, "count": count}

    def loss_fn(params, batch, frozen, rng):
        if runs_loss(model):  # no aux: mixture-of-experts layers are never pipelined
            return pipelined_loss(model, params, batch, rng, head_loss)
        logits, aux = forward(model, params, batch, rng)
        return add_aux(model, *head_loss(logits, batch), aux)

    return loss_fn


def sft_loss(model):
    """Cross-entropy on the assistant tokens the data marked (loss_mask), normalised by their
    global count; also counts every real token, for the share the mask leaves out."""
    base = pretrain_loss(model)

    def loss_fn(params, batch, frozen, rng):
        objective, stats = base(params, batch, frozen, rng)
        return objective, stats | {"input_tokens_total": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)}

    return loss_fn
