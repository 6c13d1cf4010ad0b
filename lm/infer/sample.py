"""Text generation by repeated forward passes over a fixed-length buffer (one compile).

A KV-cached decoder comes with the inference stage; this is enough to show what a
freshly trained model writes at the end of a run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def generate(model, params, prompt_ids, n_new: int, max_len: int, *, temperature: float = 0.8,
             seed: int = 0) -> np.ndarray:
    """Appends up to n_new sampled tokens to prompt_ids (total capped at max_len); returns all ids."""
    prompt_ids = np.asarray(prompt_ids, np.int32)[-(max_len - 1):]
    n_prompt = len(prompt_ids)
    total = min(max_len, n_prompt + n_new)
    buf = jnp.zeros((1, total), jnp.int32).at[0, :n_prompt].set(prompt_ids)
    segments = jnp.ones((1, total), jnp.int32)
    positions = jnp.arange(total, dtype=jnp.int32)[None]

    @jax.jit
    def next_token(params, buf, t, rng):
        logits = model.apply({"params": params}, buf, segments, positions)[0, t - 1]
        if temperature <= 0:
            return jnp.argmax(logits).astype(jnp.int32)
        return jax.random.categorical(rng, logits / temperature).astype(jnp.int32)

    rng = jax.random.PRNGKey(seed)
    for t in range(n_prompt, total):  # causal mask: later buffer slots do not affect slot t-1
        buf = buf.at[0, t].set(next_token(params, buf, t, jax.random.fold_in(rng, t)))
    return np.asarray(buf[0])
