"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), min-p.

Filters follow the usual order: temperature scales the logits, then top-k, top-p and min-p
each remove tokens (set to -inf) from what is left; the token is drawn from the softmax of
the survivors. `filter_logits` is the one routine that applies them: the engine (per-row settings,
lm.infer.engine.rows), `choose` and speculative verification (lm.infer.spec_verify) all call it.

Log-probabilities reported for sampled tokens are those of the model's own distribution
(log-softmax of the raw logits), not of the filtered one: they are what RL and scoring need, and
they do not depend on the sampling settings.
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
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "at least 1"),
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1) (0 = off)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise UserError(f"sampling: {name}={getattr(self, name)!r}: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def row_settings(p: SamplingParams, shape=()) -> dict:
    """One setting as the per-row arrays `filter_logits` takes, broadcast to `shape` (the logits'
    leading axes)."""
    return {
        "temperature": jnp.full(shape, p.temperature, jnp.float32),
        "top_k": jnp.full(shape, p.top_k, jnp.int32),
        "top_p": jnp.full(shape, p.top_p, jnp.float32),
        "min_p": jnp.full(shape, p.min_p, jnp.float32),
    }


def filter_logits(logits: jax.Array, s) -> jax.Array:
    """float32 logits [..., V] -> the same with removed tokens at -inf (temperature applied).

    s: a SamplingParams (the same setting for every row), or per-row settings {temperature, top_k,
    top_p, min_p} as arrays over the logits' leading axes (0 or 1 turns a filter off, as in
    SamplingParams), so one compiled step serves any mix of requests."""
    if isinstance(s, SamplingParams):
        s = row_settings(s, logits.shape[:-1])
    temp = s["temperature"][..., None]
    x = logits.astype(jnp.float32) / jnp.where(temp > 0, temp, 1.0)
    top_k, top_p = s["top_k"][..., None], s["top_p"][..., None]

    def sorted_filters(x):
        desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, x.shape[-1] - 1), axis=-1)
        x = jnp.where((top_k > 0) & (x < kth), NEG_INF, x)
        probs = jax.nn.softmax(x, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of strictly likelier tokens
        n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # the smallest prefix reaching top_p
        cutoff = jnp.take_along_axis(sorted_probs, n_keep - 1, axis=-1)
        return jnp.where((top_p < 1.0) & (probs < cutoff), NEG_INF, x)

    # sorting the vocabulary is the costly part: skipped when no row asks for top-k or top-p
    x = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), sorted_filters, lambda x: x, x)
    probs = jax.nn.softmax(x, axis=-1)
    min_p = s["min_p"][..., None]
    return jnp.where((min_p > 0) & (probs < min_p * probs.max(axis=-1, keepdims=True)), NEG_INF, x)


def choose(rng: jax.Array, logits: jax.Array, p: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Tokens [B] and their log-probabilities under the model ([B] float32) from logits [B, V]."""
    logits = logits.astype(jnp.float32)
    if p.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(rng, filter_logits(logits, p), axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), logp
