"""Choosing tokens for a batch whose rows each have their own sampling settings.

The filters are `lm.infer.sampling.filter_logits` (temperature, then top-k, top-p, min-p), with
the settings as [B] arrays so one compiled step serves any mix of requests. Each row draws
with its own key (its request's seed folded with the token's index), so a request's tokens do not
depend on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lm.infer.sampling import SamplingParams, filter_logits


@dataclasses.dataclass
class RowSettings:
    """Per-row sampling settings as host arrays [B] (a pytree of them goes to the device)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray

    @classmethod
    def empty(cls, rows: int) -> "RowSettings":
        return cls(
            np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32), np.zeros(rows, np.float32)
        )

    def set(self, row: int, p: SamplingParams) -> None:
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row], self.top_p[row], self.min_p[row] = p.top_k, p.top_p, p.min_p

    def arrays(self) -> dict:
        return dataclasses.asdict(self)


def choose_rows(keys, logits, s: dict):
    """Tokens [B] and their log-probabilities under the model (unfiltered) from logits [B, V];
    keys [B, 2]: one PRNG key per row. Rows at temperature 0 take the argmax."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filter_logits(logits, s)).astype(jnp.int32)
        return jnp.where(s["temperature"] > 0, drawn, greedy)

    # a batch of greedy requests skips the filters and the random draws
    tokens = jax.lax.cond(jnp.any(s["temperature"] > 0), draw, lambda _: greedy, None)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def row_keys(seeds, counts):
    """One key per row: its request's base key [B, 2] (uint32) folded with its token count [B]."""
    return jax.vmap(jax.random.fold_in)(seeds, counts)
