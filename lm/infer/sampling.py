"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), min-p.

Filters follow the usual order: temperature scales the logits, then top-k, top-p and min-p
each remove tokens (set to -inf) from what is left; the token is drawn from the softmax of
the survivors. Log-probabilities reported for sampled tokens are those of the model's own
distribution (log-softmax of the raw logits), not of the filtered one: they are what RL and
scoring need, and they do not depend on the sampling settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lm.errors import UserError

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; hashable, so a jitted loop is compiled once per setting."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off: keep tokens with p >= min_p * p(most likely token)
    seed: int = 0

    def __post_init__(self):
        checks = [("max_new_tokens", self.max_new_tokens >= 1, "at least 1"),
                  ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
                  ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
                  ("min_p", 0 <= self.min_p < 1, "in [0, 1) (0 = off)")]
        for name, ok, expected in checks:
            if not ok:
                raise UserError(f"sampling: {name}={getattr(self, name)!r}: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filter_logits(logits: jax.Array, p: SamplingParams) -> jax.Array:
    """float32 logits [..., V] -> the same with removed tokens at -inf (temperature applied)."""
    x = logits.astype(jnp.float32) / (p.temperature if p.temperature > 0 else 1.0)
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, p.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG_INF, x)
    if p.top_p < 1.0:
        probs = jax.nn.softmax(x, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of strictly likelier tokens
        n_keep = jnp.sum(before < p.top_p, axis=-1, keepdims=True)  # the smallest prefix reaching top_p
        cutoff = jnp.take_along_axis(sorted_probs, n_keep - 1, axis=-1)
        x = jnp.where(probs >= cutoff, x, NEG_INF)
    if p.min_p > 0.0:
        probs = jax.nn.softmax(x, axis=-1)
        x = jnp.where(probs >= p.min_p * probs.max(axis=-1, keepdims=True), x, NEG_INF)
    return x


def choose(rng: jax.Array, logits: jax.Array, p: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Tokens [B] and their log-probabilities under the model ([B] float32) from logits [B, V]."""
    logits = logits.astype(jnp.float32)
    if p.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(rng, filter_logits(logits, p), axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), logp
