"""Losses and advantages of RL from rewards: GRPO and PPO over rollout batches.

A rollout batch is the text contract over [B, T] rows (prompt + sampled response, the loss mask
on the response tokens) plus per-token fields aligned with `targets`:
  old_logp    log-prob of each response token under the policy that sampled it
  advantages  GRPO: the row's group-relative advantage on every response token; PPO: GAE
  ref_logp    the frozen reference's log-probs (GRPO with beta > 0: the k3 KL term)
  old_values, returns   PPO's value-head outputs at sampling time and its targets
  is_weight   with stale rollouts (rl.max_staleness > 0, lm.train.rl_async): old_logp is then
              the current params' (the proximal policy) and each token's policy term is
              weighted by pi_old / pi_sampler, truncated or masked at rl.is_cap
Every log-prob (the policy's here, old_logp and ref_logp from lm.train.rollout) is taken at the
sampling temperature, log softmax(logits / temperature), as TRL does: the ratio then compares
the policy with the distribution the rollouts were drawn from (top-p's cut aside).

Policy term (PPO-clip, Schulman et al. 2017, with DAPO's separate low/high clip range):
  -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),  rho = exp(logp - old_logp)
or, with importance_sampling_level="sequence" (GSPO, Zheng et al. 2025), rho = exp(the mean of
logp - old_logp over the row's response tokens), the same on every token of the row.
GRPO (Shao et al. 2024) adds beta * k3 with k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, an
unbiased estimator of KL(policy || reference). PPO folds the KL into its per-token rewards and
adds vf_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2).

The per-token loss l is reduced as TRL's `loss_type` says, each as an (objective, count) pair
that the update routine sums over micro-batches and devices and divides once (lm.train.steps),
so each normaliser is that of the whole update:
  dapo     sum of l over the update's response tokens / their number
  grpo     sum over responses of (the response's mean l) / the number of responses
  dr_grpo  sum of l / (the number of responses x max_new_tokens)
  bnpo     each micro-batch's token mean of l, averaged over the micro-batches (TRL normalises
           per device batch; here a micro-batch, all devices together, is the local batch; with
           one micro-batch it is dapo)
`loss` is that objective; the per-token statistics (policy_loss, kl, ratio, clip_fraction,
entropy, PPO's value terms) come as totals over the response tokens with `tokens` their number,
so their means are over the update's tokens whatever the loss_type (lm.train.rl_step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lm.config.rl import LOSS_TYPES, RlSettings
from lm.model.apply import add_aux, forward, target_logprobs
from lm.model.pipeline_1f1b import pipelined_loss, runs_loss

ALGOS = ("grpo", "ppo")


# ---- advantages (host side, numpy) -----------------------------------------------------------


def group_advantages(rewards: np.ndarray, group: int, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """[P * G] rewards, G consecutive samples per prompt -> (r - group mean) / (group std + eps)
    (the sample std, as TRL); scale=False leaves out the division (Dr. GRPO).

    A NaN reward (it failed, lm.train.rewards) leaves its row out: advantage 0, and the group's
    mean and std are those of the other rows; a group with fewer than 2 rewards has none."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    ok = np.isfinite(r)
    n = ok.sum(axis=1, keepdims=True)
    mean = np.where(ok, r, 0.0).sum(axis=1, keepdims=True) / np.maximum(n, 1)
    adv = np.where(ok, r - mean, 0.0)
    if scale:
        std = np.sqrt(np.square(adv).sum(axis=1, keepdims=True) / np.maximum(n - 1, 1))
        adv = adv / (std + eps)
    return np.where(n >= 2, adv, 0.0).reshape(-1).astype(np.float32)


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float):
    """Generalised advantage estimation over each row's response tokens ([B, T] arrays, mask 1
    on them; they are contiguous). The value after a row's last token is 0 (the episode ends).
    Returns (advantages, returns = advantages + values), zero off the mask."""
    b, t = rewards.shape
    adv = np.zeros((b, t), np.float64)
    next_value, next_adv = np.zeros(b), np.zeros(b)
    for i in reversed(range(t)):
        m = mask[:, i] > 0
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = np.where(m, a, 0.0)
        next_value = np.where(m, values[:, i], next_value)
        next_adv = np.where(m, a, next_adv)
    adv = adv.astype(np.float32)
    return adv, np.where(mask > 0, adv + values, 0.0).astype(np.float32)


def whiten(x: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """x with mean 0 and std 1 over the masked-in entries (zero elsewhere)."""
    m = mask > 0
    if not m.any():
        return np.zeros_like(x, np.float32)
    mean, std = x[m].mean(), x[m].std()
    return np.where(m, (x - mean) / (std + eps), 0.0).astype(np.float32)


# ---- per-token terms ------------------------------------------------------------------------


def tempered(logits, temperature: float):
    """float32 logits / temperature: the distribution rollouts are sampled from (before top-p)."""
    logits = logits.astype(jnp.float32)
    return logits if temperature == 1.0 else logits / temperature


def tempered_logprobs(logits, targets, temperature: float):
    """log p(target) [B, T] under softmax(logits / temperature)."""
    return target_logprobs(tempered(logits, temperature), targets)[0]


def k3(logp, ref_logp):
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def importance_ratio(logp, old_logp, mask, level: str = "token"):
    """pi / pi_old per token ([B, T]); level "sequence" (GSPO): exp(each row's mean log-ratio over
    its response tokens), broadcast to every token of the row."""
    log_ratio = jnp.where(mask > 0, logp - old_logp, 0.0)
    if level == "sequence":
        n = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio * mask, axis=-1, keepdims=True) / n, log_ratio.shape)
    elif level != "token":
        raise ValueError(f"importance sampling level {level!r}: expected 'token' or 'sequence'")
    return jnp.exp(log_ratio)


def policy_terms(ratio, adv, eps_low: float, eps_high: float):
    """(per-token clipped policy loss, 1 where the clip is active)."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


def value_terms(values, old_values, returns, clip: float):
    """(per-token clipped value loss 0.5 max(...), 1 where the clipped branch is the larger)."""
    v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    a, b = jnp.square(values - returns), jnp.square(v_clipped - returns)
    return 0.5 * jnp.maximum(a, b), (b > a).astype(jnp.float32)


def entropy(logits):
    """Per-position entropy of the softmax of float32 logits [..., V]."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def aggregate(per_token, mask, loss_type: str, max_new_tokens: int):
    """(objective, count) of the per-token loss over one micro-batch (the module doc's table)."""
    masked = jnp.where(mask > 0, per_token * mask, 0.0)
    lengths = jnp.sum(mask, axis=-1)
    responses = jnp.sum((lengths > 0).astype(jnp.float32))
    if loss_type == "dapo":
        return jnp.sum(masked), jnp.sum(mask)
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(masked, axis=-1) / jnp.maximum(lengths, 1.0)), responses
    if loss_type == "dr_grpo":
        return jnp.sum(masked) / max_new_tokens, responses
    if loss_type == "bnpo":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0), jnp.ones((), jnp.float32)
    raise ValueError(f"rl loss_type {loss_type!r}: expected one of {LOSS_TYPES}")


def _totals(mask, **per_token) -> dict:
    return {f"{k}_total": jnp.sum(jnp.where(mask > 0, v * mask, 0.0)) for k, v in per_token.items()}


def rl_loss(model, settings: RlSettings):
    """LossFn of GRPO or PPO over a rollout batch (see the module doc); under a 1F1B pipeline
    (lm.model.pipeline_1f1b) it runs per pipeline micro-batch on the last stage."""
    s, ppo = settings, settings.algo == "ppo"

    def objective(out, batch):
        logits, values = out if ppo else (out, None)
        mask = batch["loss_mask"].astype(jnp.float32)
        logits = tempered(logits, s.temperature)
        logp, _ = target_logprobs(logits, batch["targets"])
        ratio = importance_ratio(logp, batch["old_logp"], mask, s.importance_sampling_level)
        pg, clipped = policy_terms(ratio, batch["advantages"], s.eps_low, s.eps_high)
        if "is_weight" in batch:  # rollouts sampled by older params (lm.train.rl_async): their correction
            pg = pg * batch["is_weight"]
        per_token, extra = pg, {}
        if ppo:
            vloss, vclipped = value_terms(values, batch["old_values"], batch["returns"], s.value_clip)
            per_token = pg + s.vf_coef * vloss
            extra = {"value_loss": vloss, "value_clip_fraction": vclipped}
        elif s.beta > 0:
            kl = k3(logp, batch["ref_logp"])
            per_token = pg + s.beta * kl
            extra = {"kl": kl}
        value, count = aggregate(per_token, mask, s.loss_type, s.max_new_tokens)
        totals = _totals(
            mask,
            policy_loss=pg,
            clip_fraction=clipped,
            ratio=ratio,
            entropy=jax.lax.stop_gradient(entropy(logits)),
            **extra,
        )
        return value, totals | {"loss_sum": value, "count": count, "tokens_total": jnp.sum(mask)}

    output = "logits_and_scalar" if ppo else "logits"

    def loss_fn(params, batch, frozen, rng):
        if runs_loss(model):
            return pipelined_loss(model, params, batch, rng, objective, output=output)
        out, aux = forward(model, params, batch, rng, output=output)
        return add_aux(model, *objective(out, batch), aux)

    return loss_fn
