"""The pure pieces of speculative decoding: distributions from logits, the rejection sampler that
keeps a prefix of drafted tokens, and prompt-lookup n-gram drafts.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): a draft x drawn from q is kept with
probability min(1, p(x)/q(x)); at the first rejection the token is drawn from normalize(max(0, p - q))
instead, and when every draft is kept a bonus token is drawn from p. Each emitted token is then
distributed exactly as p, whatever q is. p and q are the *filtered* distributions (temperature,
top-k, top-p, min-p), so speculation samples what plain decoding with the same settings samples.
Greedy decoding is the same rule over point masses: p is one-hot at the target's argmax, so a
draft is kept iff it is that argmax, and a rejection emits the argmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.infer.sampling import SamplingParams, filter_logits

NGRAM_MAX = 3  # prompt lookup tries the last 3, then 2, then 1 tokens


def probs_of(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """float32 [..., V] logits -> the distribution tokens are drawn from under `sampling`
    (one-hot at the argmax of the raw logits when greedy, as `sampling.choose` picks)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filter_logits(logits, sampling), axis=-1)


def draw(key: jax.Array, probs: jax.Array, greedy: bool = False) -> jax.Array:
    """One token from each distribution [..., V]. greedy: the distributions are one-hot, and
    their argmax is what a draw returns, without drawing V random numbers."""
    if greedy:
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="greedy")
def accept_drafts(
    key: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array, n_valid: jax.Array, greedy: bool = False
) -> tuple[jax.Array, jax.Array]:
    """How many drafts to keep and the token that follows them.

    p [k+1, V]: the target's distributions for the token after the pending one and after each
    draft; q [k, V]: the draft's distributions the drafts were drawn from; drafts [k] int32;
    n_valid: only drafts[:n_valid] count (the rest are padding: past the token budget, or no
    n-gram match). greedy: p is one-hot (the same result, without drawing). Returns
    (n_accepted in [0, n_valid], next token): the emitted tokens are drafts[:n_accepted], then next.
    """
    k = drafts.shape[0]
    key_u, key_next = jax.random.split(key)
    u = jax.random.uniform(key_u, (k,))
    i = jnp.arange(k)
    px, qx = p[i, drafts], q[i, drafts]
    keep = (u * qx < px) & (i < n_valid)  # u < p/q without dividing; q(x) > 0 for a drawn x
    n_acc = jnp.sum(jnp.cumprod(keep.astype(jnp.int32)))
    p_at = p[n_acc]
    q_at = jnp.concatenate([q, jnp.zeros_like(q[:1])])[n_acc]
    rejected = n_acc < n_valid
    residual = jnp.where(rejected, jnp.maximum(p_at - q_at, 0.0), p_at)
    # p == q leaves nothing to resample from; a rejection then has probability 0 (rounding aside)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p_at)
    return n_acc.astype(jnp.int32), draw(key_next, residual, greedy)


def ngram_drafts(context: jax.Array, length: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup drafts: the k tokens that followed the most recent earlier occurrence of the
    context's last n tokens (n = 3, then 2, then 1).

    context [S] int32: the tokens so far (prompt, then generated) at their positions; only
    context[:length] counts. Returns (drafts [k] int32, how many of them count: k after a match,
    0 without one). A match near the end means the text repeats with period p = length - (match
    end): the drafts then go on repeating it (a run of one token drafts k more of it, not one).
    """
    s = context.shape[0]
    start_at = jnp.arange(s)
    padded = jnp.concatenate([context, jnp.zeros((NGRAM_MAX,), context.dtype)])
    follow, found = jnp.zeros((), jnp.int32), jnp.zeros((), bool)
    for n in range(NGRAM_MAX, 0, -1):  # the longest suffix that has a match wins
        suffix = jax.lax.dynamic_slice(padded, (jnp.maximum(length - n, 0),), (n,))
        match = (start_at + n < length) & (length >= n)  # an earlier window with a token after it
        for j in range(n):
            match &= padded[start_at + j] == suffix[j]
        last = jnp.max(jnp.where(match, start_at, -1))
        hit = (last >= 0) & ~found
        follow = jnp.where(hit, last + n, follow)
        found |= hit
    period = jnp.maximum(length - follow, 1)
    drafts = padded[jnp.clip(follow + jnp.arange(k) % period, 0, s - 1)]
    return drafts, jnp.where(found, k, 0).astype(jnp.int32)
