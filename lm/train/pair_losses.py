"""Losses over preference pairs: the DPO family and the Bradley-Terry reward model.

A pair batch holds the text fields as [B, 2, T] (row 0 the chosen response, row 1 the
rejected one, both after the same prompt, which the loss mask leaves out), so a pair never
splits across micro-batches or devices, and both sides go through the model in one pass
as [2B, T]. A pair whose loss mask is all zero is padding: it counts nowhere. Statistics
are sums over pairs and `count` is the number of pairs, so the step's update is the mean
over the global batch's pairs whatever the micro-batch split.

DPO (Rafailov et al. 2023), with z = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)) over
the summed response log-probs:
  sigmoid  -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)  (eps > 0: conservative DPO)
  ipo      (z_avg - 1 / (2 beta))^2, z_avg from per-token averaged log-probs (Azar et al. 2023)
  simpo    -log sigmoid(beta (log pi(c) / |c| - log pi(r) / |r|) - gamma), no reference (Meng et al. 2024)
  orpo     NLL(c) - beta log sigmoid(log odds(c) - log odds(r)), odds(y) = P / (1 - P) with P the
           per-token mean probability exp(log pi(y) / |y|); no reference (Hong et al. 2024). The NLL
           is TRL's: the summed chosen NLL over the chosen tokens of the micro-batch
beta is dpo.beta or, when that is 0, the loss's default (lm.config.dpo.LOSS_BETA).
Plus, when rpo_alpha > 0 (RPO, Pang et al. 2024), rpo_alpha times the chosen responses' NLL:
  per_response  each pair's chosen NLL / |c| (the paper's), so the step adds the mean over pairs
  per_token     the summed chosen NLL / the chosen tokens of the micro-batch, the same on every
                pair (TRL's: a mean over the chosen tokens of its per-device batch); with
                train.micro_batches > 1 the step adds the pair-weighted mean of the micro-batches'
                token means, which depends on the split, as TRL's does under accumulation
The implicit rewards are beta (log pi - log ref) (simpo, orpo: beta log pi / length).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.config.dpo import DpoSettings
from lm.model.apply import add_aux, forward, last_real, sequence_logprobs
from lm.model.pipeline_1f1b import pipelined_loss, runs_loss

TEXT_FIELDS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
DPO_LOSSES = ("sigmoid", "ipo", "simpo", "orpo")


def flat_pairs(batch: dict) -> dict:
    """[B, 2, T] text fields -> [2B, T] rows (chosen, rejected, chosen, ...)."""
    return {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in TEXT_FIELDS}


def pair_logprobs(model, params, batch: dict, rng=None):
    """(summed response log-probs, response token counts) of each side: float32 [B, 2] each, and
    the model's auxiliary outputs (lm.model.apply.forward)."""
    rows = flat_pairs(batch)
    logits, aux = forward(model, params, rows, rng)
    logp, count = sequence_logprobs(logits, rows["targets"], rows["loss_mask"])
    return logp.reshape(-1, 2), count.reshape(-1, 2), aux


def dpo_terms(s: DpoSettings, logp, ref, count):
    """Per pair: (loss [B], chosen reward [B], rejected reward [B]) from [B, 2] summed log-probs
    of the policy and the reference (ignored by simpo) and response token counts."""
    n, beta = jnp.maximum(count, 1.0), s.loss_beta  # padding pairs have no tokens: keep their terms finite
    if s.loss == "orpo":  # its NLL term is its own: rpo_alpha stays 0
        rewards = beta * logp / n
        return chosen_nll("per_token", logp, count) - beta * jax.nn.log_sigmoid(log_odds(logp, count)), *rewards.T
    if s.loss == "simpo":
        rewards = beta * logp / n
        loss = -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1] - s.simpo_gamma)
    else:
        ratio = logp - ref
        rewards = beta * ratio
        if s.loss == "sigmoid":
            z = rewards[:, 0] - rewards[:, 1]
            eps = s.label_smoothing
            loss = -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
        elif s.loss == "ipo":
            avg = ratio / n
            loss = jnp.square(avg[:, 0] - avg[:, 1] - 1.0 / (2.0 * beta))
        else:
            raise ValueError(f"dpo loss {s.loss!r}: expected one of {DPO_LOSSES}")
    if s.rpo_alpha > 0:
        loss = loss + s.rpo_alpha * chosen_nll(s.rpo_nll, logp, count)
    return loss, rewards[:, 0], rewards[:, 1]


def log_odds(logp, count):
    """ORPO's log odds ratio per pair [B]: log(odds(c) / odds(r)), odds(y) = P(y) / (1 - P(y)) with
    P(y) = exp(the mean log-prob per token of y); log(1 - P) as log(-expm1(.)), with the mean kept
    below 0 so that a response of probability 1 (or a padding pair) stays finite."""
    mean = jnp.minimum(logp / jnp.maximum(count, 1.0), -1e-7)
    log1m = jnp.log(-jnp.expm1(mean))
    return (mean[:, 0] - mean[:, 1]) - (log1m[:, 0] - log1m[:, 1])


def chosen_nll(mode: str, logp, count):
    """RPO's NLL per pair [B] from [B, 2] summed log-probs and token counts (the module doc):
    per_response: -log pi(c) / |c|; per_token: -sum log pi(c) / sum |c| over the real pairs."""
    if mode == "per_response":
        return -logp[:, 0] / jnp.maximum(count[:, 0], 1.0)
    if mode == "per_token":
        real = jnp.all(count > 0, axis=-1)
        tokens = jnp.sum(jnp.where(real, count[:, 0], 0.0))
        mean = -jnp.sum(jnp.where(real, logp[:, 0], 0.0)) / jnp.maximum(tokens, 1.0)
        return jnp.broadcast_to(mean, logp[:, 0].shape)
    raise ValueError(f"dpo rpo_nll {mode!r}: expected 'per_response' or 'per_token'")


def _pair_stats(valid, loss, **per_pair) -> dict:
    """Sums over the real pairs of per-pair values; count = number of pairs."""
    v = valid.astype(jnp.float32)
    out = {"loss_sum": jnp.sum(jnp.where(valid, loss, 0.0)), "count": jnp.sum(v)}
    return out | {f"{k}_sum": jnp.sum(jnp.where(valid, x, 0.0)) for k, x in per_pair.items()}


def reference_logps(reference: str, frozen, batch: dict):
    """[B, 2] summed log-probs of the reference: 'live' runs frozen['reference'] (no gradient),
    'precomputed' reads batch['ref_logps'], 'none' gives zeros."""
    if reference == "precomputed":
        return batch["ref_logps"]
    if reference == "none":
        return jnp.zeros(batch["inputs"].shape[:2], jnp.float32)
    ref = frozen["reference"]
    return jax.lax.stop_gradient(pair_logprobs(ref.module, ref.params, batch)[0])


def dpo_loss(model, settings: DpoSettings, reference: str = "live"):
    """LossFn of DPO. reference: where the reference log-probs come from:
    'live'         the frozen model 'reference' (a copy of the init model, or a LoRA policy's
                   own base with the adapters off) runs beside the policy;
    'precomputed'  batch['ref_logps'] [B, 2];
    'none'         simpo needs no reference.
    Under a 1F1B pipeline (lm.model.pipeline_1f1b) the pairs run inside it, each pair's two rows in
    one of its micro-batches (RPO's per_token mean is then over a pipeline micro-batch's pairs)."""

    ref_logps = functools.partial(reference_logps, reference)

    def objective(logp, count, ref):
        valid = jnp.all(count > 0, axis=-1)
        loss, chosen, rejected = dpo_terms(settings, logp, ref, count)
        stats = _pair_stats(
            valid,
            loss,
            **{
                "rewards/chosen": chosen,
                "rewards/rejected": rejected,
                "rewards/accuracies": (chosen > rejected).astype(jnp.float32),
                "rewards/margins": chosen - rejected,
                "logps/chosen": logp[:, 0],
                "logps/rejected": logp[:, 1],
                "logps/accuracies": (logp[:, 0] > logp[:, 1]).astype(jnp.float32),
            }
            | (orpo_metrics(logp, count) if settings.loss == "orpo" else {}),
        )
        tokens = jnp.sum(jnp.where(valid[:, None], count, 0.0))
        return stats["loss_sum"], stats | {"pairs_total": stats["count"], "tokens_total": tokens}

    def head(logits, rows):
        """One 1F1B micro-batch's pairs, as consecutive (chosen, rejected) rows."""
        logp, count = sequence_logprobs(logits, rows["targets"], rows["loss_mask"])
        return objective(logp.reshape(-1, 2), count.reshape(-1, 2), rows["ref_logps"].reshape(-1, 2))

    def loss_fn(params, batch, frozen, rng):
        if runs_loss(model):  # the pairs run through a 1F1B pipeline, a pair's two rows together
            rows = flat_pairs(batch) | {"ref_logps": ref_logps(frozen, batch).reshape(-1)}
            return pipelined_loss(model, params, rows, rng, head, group=2)
        logp, count, aux = pair_logprobs(model, params, batch, rng)
        return add_aux(model, *objective(logp, count, ref_logps(frozen, batch)), aux)

    return loss_fn


def orpo_metrics(logp, count) -> dict:
    """TRL's ORPO metrics per pair: log sigmoid(log odds), the log odds and the chosen NLL."""
    odds = log_odds(logp, count)
    nll = chosen_nll("per_token", logp, count)
    return {"log_odds_ratio": jax.nn.log_sigmoid(odds), "log_odds_chosen": odds, "nll_loss": nll}


def reward_terms(r_chosen, r_rejected, margin, center_coef: float):
    """Bradley-Terry loss per pair: -log sigmoid(r_c - r_r - margin) + center_coef (r_c + r_r)^2."""
    loss = -jax.nn.log_sigmoid(r_chosen - r_rejected - margin)
    return loss + center_coef * jnp.square(r_chosen + r_rejected) if center_coef else loss


def reward_loss(model, center_coef: float = 0.0):
    """LossFn of a Bradley-Terry reward model (a scalar head on the trunk); under a 1F1B pipeline
    the pairs run inside it, as DPO's do (`dpo_loss`)."""

    def objective(scores, rows):
        """(objective_sum, sums) of pairs given as consecutive (chosen, rejected) rows."""
        scores = jnp.take_along_axis(scores, last_real(rows["segment_ids"])[:, None], axis=-1).reshape(-1, 2)
        side_tokens = jnp.sum(rows["loss_mask"], axis=-1).reshape(-1, 2)
        valid = jnp.all(side_tokens > 0, axis=-1)
        chosen, rejected = scores[:, 0], scores[:, 1]
        loss = reward_terms(chosen, rejected, rows["margin"].reshape(-1, 2)[:, 0], center_coef)
        stats = _pair_stats(
            valid,
            loss,
            accuracy=(chosen > rejected).astype(jnp.float32),
            margin=chosen - rejected,
            **{"rewards/chosen": chosen, "rewards/rejected": rejected},
        )
        tokens = jnp.sum(jnp.where(valid[:, None], side_tokens, 0.0))
        return stats["loss_sum"], stats | {"pairs_total": stats["count"], "tokens_total": tokens}

    def loss_fn(params, batch, frozen, rng):
        rows = flat_pairs(batch) | {"margin": jnp.repeat(jnp.asarray(batch["margin"], jnp.float32), 2)}
        if runs_loss(model):
            return pipelined_loss(model, params, rows, rng, objective, group=2, output="scalar")
        scores, aux = forward(model, params, rows, rng, output="scalar")
        return add_aux(model, *objective(scores, rows), aux)

    return loss_fn
