"""The engine's decode block with speculation: every live row gets k drafts from a proposer, the
target scores each row's pending token and its drafts in ONE forward pass over the paged pool (a
chunk of k+1 tokens per row), and each row keeps the prefix of its drafts that the rejection
sampler accepts (`spec_verify.accept_drafts`, per row), then the token that follows.

Proposers: prompt lookup (`ngram_proposals`: `spec_verify.ngram_drafts` over the row's own
history, point-mass drafts) or a draft model (lm.infer.engine.draft_steps: drafts drawn from the
draft's filtered distributions). A proposer is (params, pool, state, feed, keys, table) ->
(drafts [S, k], their distributions q [S, k, V], how many count [S], pool).

Rows differ in their settings (greedy rows take the argmax: a point mass, so a draft is kept iff it
is the argmax and greedy output equals plain decoding; sampled rows follow the target's filtered
distribution exactly), in how many drafts they have (none without a match: the step is then a
plain step for that row) and in how many they keep, so each row writes its own number of tokens
into the outputs. A token's pool slot is its position and a query sees only slots at or before
its own, so rejected drafts need no rollback: their slots are written again before any query
can see them (and lie past everything the prefix cache remembers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.infer.engine.rows import row_keys
from lm.infer.engine.steps import NO_TOKEN, forward, run_steps
from lm.infer.sampling import filter_logits
from lm.infer.spec_verify import accept_drafts, ngram_drafts


def row_probs(logits, settings):
    """float32 logits [S, t, V] -> each row's distributions under its settings: one-hot at the
    argmax for greedy rows, the filtered softmax for the others."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def with_sampled(_):
        per_token = {
            name: jnp.broadcast_to(settings[name][:, None], logits.shape[:2])
            for name in ("temperature", "top_k", "top_p", "min_p")
        }
        sampled = jax.nn.softmax(filter_logits(logits, per_token), axis=-1)
        return jnp.where((settings["temperature"] > 0)[:, None, None], sampled, greedy)

    # a batch of greedy rows skips the filters (their sorts over the vocabulary)
    return jax.lax.cond(jnp.any(settings["temperature"] > 0), with_sampled, lambda _: greedy, None)


def ngram_proposals(k: int, vocab: int, params, pool, s, feed, keys, table):
    """Prompt-lookup drafts: point masses, as many as the row's history matches (0 or k)."""
    drafts, found = jax.vmap(ngram_drafts, in_axes=(0, 0, None))(s["history"], s["pos"] + 1, k)
    n_valid = jnp.where(feed, jnp.minimum(found, s["left"] - 1), 0)
    return drafts, jax.nn.one_hot(drafts, vocab, dtype=jnp.float32), n_valid, pool


def _emitted(s, chunk, logits, n_acc, n_valid, feed, live, k):
    """(tokens emitted [S], whether the row goes on [S]): the pending token and the kept drafts,
    up to and including an end id."""
    j = jnp.arange(k + 1)
    is_end = jnp.any(chunk[..., None] == s["eos"][:, None, :], axis=-1) & (j >= 1) & (j <= n_acc[:, None])
    stop_at = jnp.where(jnp.any(is_end, axis=1), jnp.argmax(is_end, axis=1), k + 1)
    n_emit = jnp.where(live, jnp.where(feed, jnp.minimum(n_acc + 1, stop_at + 1), 1), 0)
    go_on = feed & (stop_at > k) & (s["left"] - n_emit >= 1)
    return n_emit, go_on


def speculative_block(model, propose, n: int, every: int, k: int, params, pool, state, table, limit):
    """As `steps.decode_block`, each step emitting 1 to k+1 tokens per row; params and pool are
    (target's, proposer's) pairs; state also holds history [S, H] (each row's tokens at their
    positions, its pending token at `pos`), proposed and accepted [S] (drafts counted and kept,
    cumulative), passes [S] (verify passes that fed the row). `limit` counts steps; out is
    [S, n*(k+1)]."""
    rows = state["tokens"].shape[0]
    width = n * (k + 1)
    j = jnp.arange(k + 1)

    def step(_, c):
        s, i = c["s"], c["i"]
        live = s["live"] & (i < c["limit"])
        ended = jnp.any(s["tokens"][:, None] == s["eos"], axis=-1) | (s["left"] <= 1)
        feed = live & ~ended
        keys = row_keys(s["keys"], s["count"])
        t_pool, d_pool = c["pool"]
        drafts, q, n_valid, d_pool = propose(params[1], d_pool, s, feed, keys, table)
        chunk = jnp.concatenate([s["tokens"][:, None], drafts], axis=1)  # [S, k+1]: pending, then drafts
        seg = (feed[:, None] & (j <= n_valid[:, None])).astype(jnp.int32)
        logits, t_pool = forward(model, params[0], t_pool, chunk, seg, s["pos"][:, None] + j, table)
        logits = logits.astype(jnp.float32)
        n_acc, following = jax.vmap(accept_drafts)(keys, row_probs(logits, s["settings"]), q, drafts, n_valid)
        n_emit, go_on = _emitted(s, chunk, logits, n_acc, n_valid, feed, live, k)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        draft_logp = jnp.take_along_axis(logp_all[:, :-1], drafts[..., None], axis=-1)[..., 0]
        chunk_logp = jnp.concatenate([s["logp"][:, None], draft_logp], axis=1)
        where = jnp.where(j < n_emit[:, None], c["w"][:, None] + j, width)  # past the end: dropped
        r = jnp.arange(rows)[:, None]
        out = c["out"].at[r, where].set(chunk, mode="drop")
        out_logp = c["out_logp"].at[r, where].set(chunk_logp, mode="drop")
        next_logp = jnp.take_along_axis(logp_all, n_acc[:, None, None], axis=1)[:, 0]
        next_logp = jnp.take_along_axis(next_logp, following[:, None], axis=-1)[:, 0]
        after = jax.vmap(lambda d, a, f: jnp.concatenate([d, d[:1]]).at[a].set(f))(drafts, n_acc, following)
        history = jax.vmap(lambda h, x, p: jax.lax.dynamic_update_slice(h, x, (p + 1,)))(s["history"], after, s["pos"])
        s = s | dict(
            tokens=jnp.where(go_on, following, s["tokens"]),
            logp=jnp.where(go_on, next_logp, s["logp"]),
            pos=jnp.where(go_on, s["pos"] + n_acc + 1, s["pos"]),
            live=jnp.where(i < c["limit"], go_on, s["live"]),
            count=s["count"] + jnp.where(go_on, n_acc + 1, 0),
            left=s["left"] - n_emit,
            history=jnp.where(go_on[:, None], history, s["history"]),
            proposed=s["proposed"] + n_valid,
            accepted=s["accepted"] + jnp.where(feed, n_acc, 0),
            passes=s["passes"] + feed,
        )
        return c | dict(pool=(t_pool, d_pool), s=s, i=i + 1, out=out, out_logp=out_logp, w=c["w"] + n_emit)

    start = dict(
        pool=pool,
        s=state,
        out=jnp.full((rows, width), NO_TOKEN, jnp.int32),
        out_logp=jnp.zeros((rows, width), jnp.float32),
        w=jnp.zeros((rows,), jnp.int32),
    )
    end = run_steps(step, start, state["live"], jnp.minimum(limit, n), every)
    return end["pool"], end["s"], end["out"], end["out_logp"]


def _ngram_block(model, n, every, k, params, pool, state, table, limit):
    propose = functools.partial(ngram_proposals, k, model.spec.vocab_size)
    (pool, _), state, out, out_logp = speculative_block(
        model, propose, n, every, k, (params, None), (pool, None), state, table, limit
    )
    return pool, state, out, out_logp


@functools.lru_cache(maxsize=32)
def compiled_speculative(model, n: int, every: int, k: int):
    """The jitted speculative decode block of one model and k with prompt-lookup drafts (as
    `steps.compiled`'s decode)."""
    return jax.jit(functools.partial(_ngram_block, model, n, every, k), donate_argnums=1)
