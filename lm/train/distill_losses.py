"""Token-level distillation divergences between a student's and a teacher's next-token distributions.

Both [B, T, V] logits are scaled by 1 / temperature and normalised (log_softmax, in float32); each
position then gets one divergence over the vocabulary (GKD, Agarwal et al. 2024; the generalized
JSD of TRL's GKDTrainer):
  forward_kl  KL(teacher || student): mass-covering, the classic distillation loss
  reverse_kl  KL(student || teacher): mode-seeking, the on-policy choice
  jsd         beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta p_t + (1 - beta) p_s;
              as GKD defines the limits, beta = 0 is forward_kl and beta = 1 is reverse_kl.
No temperature**2 factor is applied (GKD and TRL apply none); a caller that wants the gradient
scale of Hinton et al. multiplies by it. The teacher is not stop-gradiented here.

A probability of 0 (a -inf logit, e.g. a vocabulary entry masked out) contributes 0, never NaN, and
masked-out positions are zeroed before and after the math, so NaN or inf in their logits reaches
neither the loss nor its gradient. `kind`, `beta` and `temperature` are static Python values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lm.model.apply import add_aux, forward
from lm.train.losses import masked_cross_entropy

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def check_divergence(kind: str, beta: float, temperature: float) -> None:
    if kind not in DIVERGENCES:
        raise ValueError(f"distillation divergence {kind!r} is not one of {', '.join(DIVERGENCES)}")
    if not 0.0 <= beta <= 1.0:  # written so that NaN fails too
        raise ValueError(f"distillation beta {beta!r} must be in [0, 1]")
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"distillation temperature {temperature!r} must be a finite number > 0")


def _kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """sum_v p (log p - log q) over the last axis; entries with p == 0 give exactly 0.

    The difference is zeroed before the product (not after) so that -inf - -inf never makes a NaN
    in the value or, through a zero cotangent, in the gradient."""
    p = jnp.exp(logp)
    diff = jnp.where(p > 0, logp - logq, 0.0)
    return jnp.sum(p * diff, axis=-1)


def token_divergence(
    student_logits: jax.Array, teacher_logits: jax.Array, kind: str, beta: float = 0.5, temperature: float = 1.0
) -> jax.Array:
    """[B, T, V] logits -> float32 [B, T] divergence at each position (see the module docstring)."""
    check_divergence(kind, beta, temperature)
    logp_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    logp_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _kl(logp_t, logp_s)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _kl(logp_s, logp_t)
    # The mixture in log space. Where both are -inf (an entry neither model can emit) logaddexp's
    # gradient is NaN even under a zero cotangent, so those entries are fed zeros and set after.
    a, b = logp_t + math.log(beta), logp_s + math.log1p(-beta)
    dead = (a == -jnp.inf) & (b == -jnp.inf)
    log_m = jnp.where(dead, -jnp.inf, jnp.logaddexp(jnp.where(dead, 0.0, a), jnp.where(dead, 0.0, b)))
    return beta * _kl(logp_t, log_m) + (1.0 - beta) * _kl(logp_s, log_m)


def masked_divergence(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    mask: jax.Array,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """(sum of divergence * mask over positions with mask != 0, sum of mask): float32 scalars, so the
    mean over a batch is one division whatever the micro-batch split."""
    mask = mask.astype(jnp.float32)
    keep = mask != 0
    # Zero the logits of masked-out positions first: a NaN there would otherwise come back through
    # the gradient as 0 * NaN even though the output `where` drops it.
    student = jnp.where(keep[..., None], student_logits.astype(jnp.float32), 0.0)
    teacher = jnp.where(keep[..., None], teacher_logits.astype(jnp.float32), 0.0)
    div = token_divergence(student, teacher, kind, beta, temperature)
    div_sum = jnp.sum(jnp.where(keep, div * mask, 0.0))
    return div_sum, jnp.sum(mask)


def top1_agreement(
    student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(positions with mask != 0 where both argmaxes agree, positions with mask != 0): float32."""
    keep = mask != 0
    agree = jnp.argmax(student_logits, axis=-1) == jnp.argmax(teacher_logits, axis=-1)
    return jnp.sum(keep & agree, dtype=jnp.float32), jnp.sum(keep, dtype=jnp.float32)


def distill_loss(model, kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0):
    """LossFn of token-level distillation from the frozen model 'teacher' (any shape sharing the
    vocabulary) on the positions the data marks (loss_mask: the responses). The objective is the
    summed divergence; the student's own response loss and the top-1 agreement are logged beside it."""
    check_divergence(kind, beta, temperature)

    def loss_fn(params, batch, frozen, rng):
        student, aux = forward(model, params, batch, rng)
        teacher = jax.lax.stop_gradient(frozen["teacher"].apply(batch))
        mask = batch["loss_mask"].astype(jnp.float32)
        div, count = masked_divergence(student, teacher, mask, kind, beta, temperature)
        nll, _, _ = masked_cross_entropy(student, batch["targets"], mask)
        agree, _ = top1_agreement(student, teacher, mask)
        return add_aux(model, div, {"loss_sum": div, "nll_sum": nll, "top1_agreement_sum": agree, "count": count}, aux)

    return loss_fn
