"""Choosing tokens for a batch whose rows each have their own sampling settings.

The filters are those of `lm.infer.sampling.filter_logits` (temperature, then top-k, top-p, min-p),
with the settings as [B] arrays so one compiled step serves any mix of requests. Each row draws
with its own key (its request's seed folded with the token's index), so a request's tokens do not
depend on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lm.infer.sampling import NEG_INF, SamplingParams


@dataclasses.dataclass
class RowSettings:
    """Per-row sampling settings as host arrays [B] (a pytree of them goes to the device)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray

    @classmethod
    def empty(cls, rows: int) -> "RowSettings":
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
                   np.zeros(rows, np.float32))

    def set(self, row: int, p: SamplingParams) -> None:
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row], self.top_p[row], self.min_p[row] = p.top_k, p.top_p, p.min_p

    def arrays(self) -> dict:
        return dataclasses.asdict(self)


def filter_rows(logits, s: dict):
    """float32 logits [B, V] -> the same with each row's removed tokens at -inf (temperature applied)."""
    temp = s["temperature"][:, None]
    x = logits / jnp.where(temp > 0, temp, 1.0)

    def sorted_filters(x):
        desc = -jnp.sort(-x, axis=-1)
        k = s["top_k"][:, None]
        kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, x.shape[-1] - 1), axis=-1)
        x = jnp.where((k > 0) & (x < kth), NEG_INF, x)
        probs = jax.nn.softmax(x, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        n_keep = jnp.sum(before < s["top_p"][:, None], axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_probs, n_keep - 1, axis=-1)
        return jnp.where((s["top_p"][:, None] < 1.0) & (probs < cutoff), NEG_INF, x)

    # sorting the vocabulary is the costly part: skipped when no row asks for top-k or top-p
    needs_sort = jnp.any((s["top_k"] > 0) | (s["top_p"] < 1.0))
    x = jax.lax.cond(needs_sort, sorted_filters, lambda x: x, x)
    probs = jax.nn.softmax(x, axis=-1)
    min_p = s["min_p"][:, None]
    return jnp.where((min_p > 0) & (probs < min_p * probs.max(axis=-1, keepdims=True)), NEG_INF, x)


def choose_rows(keys, logits, s: dict):
    """Tokens [B] and their log-probabilities under the model (unfiltered) from logits [B, V];
    keys [B, 2]: one PRNG key per row. Rows at temperature 0 take the argmax."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filter_rows(logits, s)).astype(jnp.int32)
        return jnp.where(s["temperature"] > 0, drawn, greedy)

    # a batch of greedy requests skips the filters and the random draws
    tokens = jax.lax.cond(jnp.any(s["temperature"] > 0), draw, lambda _: greedy, None)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def row_keys(seeds, counts):
    """One key per row: its request's base key [B, 2] (uint32) folded with its token count [B]."""
    return jax.vmap(jax.random.fold_in)(seeds, counts)
