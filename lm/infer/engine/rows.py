"""Choosing tokens for a batch whose rows each have their own sampling settings.

The filters are `lm.infer.sampling.filter_logits` (temperature, then top-k, top-p, min-p), with
the settings as [B] arrays so one compiled step serves any mix of requests. Each row draws
with its own key (its request's seed folded with the token's index), so a request's tokens do not
depend on which other requests share the batch. A row under a grammar (structured output,
lm.infer.grammar) may choose only the tokens its bitmask allows; the log-prob reported stays the
model's.
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
    allow: np.ndarray  # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set if token t may be chosen

    @classmethod
    def empty(cls, rows: int, vocab: int) -> "RowSettings":
        return cls(
            np.zeros(rows, np.float32),
            np.zeros(rows, np.int32),
            np.ones(rows, np.float32),
            np.zeros(rows, np.float32),
            np.full((rows, -(-vocab // 32)), -1, np.int32),
        )

    def set(self, row: int, p: SamplingParams, allow: np.ndarray | None = None) -> None:
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row], self.top_p[row], self.min_p[row] = p.top_k, p.top_p, p.min_p
        self.allow[row] = -1 if allow is None else allow

    def arrays(self) -> dict:
        return dataclasses.asdict(self)


def choose_rows(keys, logits, s: dict):
    """Tokens [B] and their log-probabilities under the model (unfiltered) from logits [B, V];
    keys [B, 2]: one PRNG key per row. Rows at temperature 0 take the argmax."""
    logits = logits.astype(jnp.float32)
    model_logp = jax.nn.log_softmax(logits, axis=-1)
    logits = jax.lax.cond(jnp.any(s["allow"] != -1), _allowed, lambda x, _: x, logits, s["allow"])
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, filter_logits(logits, s)).astype(jnp.int32)
        return jnp.where(s["temperature"] > 0, drawn, greedy)

    # a batch of greedy requests skips the filters and the random draws
    tokens = jax.lax.cond(jnp.any(s["temperature"] > 0), draw, lambda _: greedy, None)
    logp = jnp.take_along_axis(model_logp, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def _allowed(logits, allow):
    """logits [B, V] with the tokens outside each row's bitmask [B, W] at -inf."""
    ids = jnp.arange(logits.shape[-1])
    bits = (allow[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def row_keys(seeds, counts):
    """One key per row: its request's base key [B, 2] (uint32) folded with its token count [B]."""
    return jax.vmap(jax.random.fold_in)(seeds, counts)
