"""What every loss, scorer and sampler asks of a model: logits, token and sequence log-probs, the
scalar head's value at the last real token. Log-probs are always float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lm.model.moe import aux_sums


def logits_of(model, params, batch, rng=None, output: str = "logits"):
    """The model's logits (or another output, e.g. "scalar") for a batch; rng (training only)
    feeds dropout where the model has any."""
    return forward(model, params, batch, rng, output)[0]


def forward(model, params, batch, rng=None, output: str = "logits"):
    """(logits_of's output, aux): aux holds what the model reports beside its output, the
    mixture-of-experts layers' routing statistics ({name: [n_layers]}; empty for a dense model).
    A trained model's loss adds them with `add_aux`."""
    spec = getattr(model, "spec", None)
    dropout = rng is not None and spec is not None and spec.lora.dropout > 0
    kw = {"rngs": {"dropout": rng}} if dropout else {}
    if output != "logits":
        kw["output"] = output
    args = ({"params": params}, batch["inputs"], batch["segment_ids"], batch["positions"])
    if spec is None or not spec.moe.n_experts:
        return model.apply(*args, **kw), {}
    out, state = model.apply(*args, mutable=["aux"], **kw)
    return out, state["aux"]["moe"][0]


def add_aux(model, objective, sums: dict, aux: dict):
    """A loss's (objective_sum, sums) with the model's auxiliary losses and statistics added,
    weighted by the loss's own count (lm.model.moe.aux_sums); unchanged for a dense model."""
    if not aux:
        return objective, sums
    term, extra = aux_sums(model.spec, aux, sums["count"])
    return objective + term, sums | extra


def target_logprobs(logits, targets):
    """(log p(target) [B, T], log Z [B, T]) in float32: the one core of every text loss."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # a select and a sum over the vocab rather than a gather: exact (one term is not zero), and a
    # vocab split over devices only sums partial results (a gather on it crashes XLA's SPMD
    # partitioner inside a partly manual shard_map, as a 1F1B pipeline runs its loss)
    hit = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return target_logit - log_z, log_z


def sequence_logprobs(logits, targets, mask):
    """(summed log p of the masked-in targets, their count), per row: float32 [B] each."""
    logp, _ = target_logprobs(logits, targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask != 0, logp * mask, 0.0), axis=-1), jnp.sum(mask, axis=-1)


def token_logprobs(model, params, batch: dict):
    """log p of every target under a model: float32 [B, T]."""
    return target_logprobs(logits_of(model, params, batch), batch["targets"])[0]


def last_real(segment_ids):
    """Index of each row's last real (non-padding) position: [N, T] -> [N] int32."""
    real = segment_ids > 0
    t = segment_ids.shape[-1]
    return (t - 1 - jnp.argmax(real[..., ::-1], axis=-1)).astype(jnp.int32)


def sequence_scores(model, params, rows: dict, rng=None):
    """The scalar head's value at each row's last real token: [N] float32."""
    scores = logits_of(model, params, rows, rng, output="scalar")
    return jnp.take_along_axis(scores, last_real(rows["segment_ids"])[:, None], axis=-1)[:, 0]
