"""The engine's two compiled steps over the paged KV pool: a prefill of prompt chunks and a block of
decode steps. Shapes are fixed by the engine's buckets (rows, chunk width, page-table width), so
each shape compiles once and is reused whatever requests fill it.

Each request has a pending token: chosen but not yet emitted. A decode step emits the pending token
of every live row, ends the rows whose token is one of their end ids or whose budget is spent,
writes the others' keys and values (feeds them) and chooses their next pending token, as
`lm.infer.generate` does for a static batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.infer.engine.rows import choose_rows, row_keys

NO_TOKEN = -1


def forward(model, params, cache, ids, seg, pos, table, logits_at=None):
    """Writes a chunk of tokens [R, W] (segment 0 = padding, written nowhere) at positions `pos` of
    the sequences whose pages are `table` [R, pages] into the pool -> (float32 logits [R, W, V], or
    [R, 1, V] at index `logits_at` [R] of each row; the pool). Every step of the engine runs it, and
    speculative decoding scores its drafts with it (lm.infer.engine.spec_steps)."""
    logits, updated = model.apply(
        {"params": params, "cache": cache},
        ids,
        seg,
        pos,
        decode=True,
        logits_at=logits_at,
        page_table=table,
        mutable=["cache"],
    )
    return logits, updated["cache"]


def prefill(model, params, cache, ids, seg, pos, table, last, keys, counts, settings):
    """Writes prompt chunks [R, W] (segment 0 = padding) into the pool and chooses, from the logits
    at index `last` [R] of each row, a pending token (used by rows whose prompt ends here)."""
    logits, cache = forward(model, params, cache, ids, seg, pos, table, last)
    tokens, logp = choose_rows(row_keys(keys, counts), logits[:, 0], settings)
    return cache, tokens, logp


def decode_block(model, n: int, every: int, params, cache, state, table, limit):
    """Up to `limit` (at most `n`, the outputs' width) decode steps for all rows; state holds [S] arrays:
    tokens (pending), logp (its log-prob), pos (where it goes), live, count (tokens chosen so far),
    left (tokens it may still emit), keys [S,2], eos [S,E] (-1 = none), settings. Returns (cache, state,
    out [S,n], out_logp).

    The loop asks whether to go on every `every` steps (a fixed count in between: on a GPU each
    question is a copy to the host and a wait, and a fixed count can be replayed as one graph); it
    ends when the steps are spent or as soon as a row has ended (its slot can take a waiting request,
    its caller gets its answer)."""
    rows = state["tokens"].shape[0]

    def step(_, c):
        s, i = c["s"], c["i"]
        live = s["live"] & (i < c["limit"])  # steps past the limit (a fixed count overshooting it) do nothing
        out = c["out"].at[:, i].set(jnp.where(live, s["tokens"], NO_TOKEN), mode="drop")
        out_logp = c["out_logp"].at[:, i].set(jnp.where(live, s["logp"], 0.0), mode="drop")
        ended = jnp.any(s["tokens"][:, None] == s["eos"], axis=-1) | (s["left"] <= 1)
        feed = live & ~ended
        logits, cache = forward(
            model, params, c["cache"], s["tokens"][:, None], feed.astype(jnp.int32)[:, None], s["pos"][:, None], table
        )
        tokens, logp = choose_rows(row_keys(s["keys"], s["count"]), logits[:, 0], s["settings"])
        s = s | dict(
            tokens=jnp.where(feed, tokens, s["tokens"]),
            logp=jnp.where(feed, logp, s["logp"]),
            pos=s["pos"] + feed,
            live=jnp.where(i < c["limit"], feed, s["live"]),
            count=s["count"] + feed,
            left=s["left"] - live,
        )
        return c | dict(cache=cache, s=s, i=i + 1, out=out, out_logp=out_logp)

    start = dict(
        cache=cache,
        s=state,
        out=jnp.full((rows, n), NO_TOKEN, jnp.int32),
        out_logp=jnp.zeros((rows, n), jnp.float32),
    )
    end = run_steps(step, start, state["live"], jnp.minimum(limit, n), every)
    return end["cache"], end["s"], end["out"], end["out_logp"]


def run_steps(step, start: dict, started, limit, every: int) -> dict:
    """The device loop of a decode block: step(_, carry) -> carry (carry holds the state `s`, the
    step index `i` and `limit`) runs in fixed counts of `every` steps while fewer than `limit` steps
    have run and no row of `started` (live at the start) has ended."""

    def cond(c):
        return (c["i"] < c["limit"]) & ~jnp.any(started & ~c["s"]["live"])

    def body(c):
        return jax.lax.fori_loop(0, every, step, c) if every > 1 else step(0, c)

    return jax.lax.while_loop(cond, body, start | dict(i=jnp.zeros((), jnp.int32), limit=limit))


def steps_between_checks() -> int:
    """Decode steps between the loop's checks on this backend: 1 where a check is free (CPU, and
    TPU, whose loop conditions stay on the chip), 8 on a GPU."""
    return 8 if jax.default_backend() == "gpu" else 1


@functools.lru_cache(maxsize=32)
def compiled(model, n: int, every: int = 1):
    """The jitted prefill and decode block of one model (shared by every engine of it). The pool is
    donated; its sharding follows the input's (the engine places it once)."""
    pre = jax.jit(functools.partial(prefill, model), donate_argnums=1)
    dec = jax.jit(functools.partial(decode_block, model, n, every), donate_argnums=1)
    return pre, dec
