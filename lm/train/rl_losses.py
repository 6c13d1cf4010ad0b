"""Losses and advantages of RL from rewards: GRPO and PPO over rollout batches.

A rollout batch is the text contract over [B, T] rows (prompt + sampled response, the loss mask
on the response tokens) plus per-token fields aligned with `targets`:
  old_logp    log-prob of each response token under the policy that sampled it
  advantages  GRPO: the row's group-relative advantage on every response token; PPO: GAE
  ref_logp    the frozen reference's log-probs (GRPO with beta > 0: the k3 KL term)
  old_values, returns   PPO's value-head outputs at sampling time and its targets
Every statistic is a sum over response tokens and `count` is their number, so the update is
the mean over the whole batch's response tokens ("token-level" normalisation, as DAPO and
Dr. GRPO argue) whatever the micro-batch split.

Policy term (PPO-clip, Schulman et al. 2017, with DAPO's separate low/high clip range):
  -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),  rho = exp(logp - old_logp)
GRPO (Shao et al. 2024) adds beta * k3 with k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, an
unbiased estimator of KL(policy || reference). PPO folds the KL into its per-token rewards and
adds vf_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lm.config.rl import RlSettings
from lm.model.apply import logits_of, target_logprobs

ALGOS = ("grpo", "ppo")


# ---- advantages (host side, numpy) -----------------------------------------------------------

def group_advantages(rewards: np.ndarray, group: int, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """[P * G] rewards, G consecutive samples per prompt -> (r - group mean) / (group std + eps)
    (the sample std, as TRL); scale=False leaves out the division (Dr. GRPO)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        std = r.std(axis=1, ddof=1, keepdims=True) if group > 1 else np.zeros_like(adv[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1).astype(np.float32)


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
    mean, std = x[m].mean(), x[m].std()
    return np.where(m, (x - mean) / (std + eps), 0.0).astype(np.float32)


# ---- per-token terms ------------------------------------------------------------------------

def k3(logp, ref_logp):
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def policy_terms(logp, old_logp, adv, eps_low: float, eps_high: float):
    """(per-token clipped policy loss, 1 where the clip is active, ratio)."""
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32), ratio


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


def _sums(mask, **per_token) -> dict:
    return {f"{k}_sum": jnp.sum(jnp.where(mask > 0, v * mask, 0.0)) for k, v in per_token.items()}


def rl_loss(model, settings: RlSettings):
    """LossFn of GRPO or PPO over a rollout batch (see the module doc)."""
    ppo = settings.algo == "ppo"

    def loss_fn(params, batch, frozen, rng):
        mask = batch["loss_mask"].astype(jnp.float32)
        if ppo:
            logits, values = logits_of(model, params, batch, rng, output="logits_and_scalar")
        else:
            logits = logits_of(model, params, batch, rng)
        logp, _ = target_logprobs(logits, batch["targets"])
        pg, clipped, ratio = policy_terms(logp, batch["old_logp"], batch["advantages"],
                                          settings.eps_low, settings.eps_high)
        per_token, extra = pg, {}
        if ppo:
            vloss, vclipped = value_terms(values, batch["old_values"], batch["returns"], settings.value_clip)
            per_token = pg + settings.vf_coef * vloss
            extra = {"value_loss": vloss, "value_clip_fraction": vclipped}
        elif settings.beta > 0:
            kl = k3(logp, batch["ref_logp"])
            per_token = pg + settings.beta * kl
            extra = {"kl": kl}
        stats = _sums(mask, loss=per_token, policy_loss=pg, clip_fraction=clipped, ratio=ratio,
                      entropy=jax.lax.stop_gradient(entropy(logits)), **extra)
        return stats["loss_sum"], stats | {"count": jnp.sum(mask)}

    return loss_fn
