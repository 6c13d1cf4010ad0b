"""Draft-model proposals for the engine's speculative decode block (lm.infer.engine.spec_steps).

A draft is a smaller model with the target's vocabulary. It keeps its own paged KV pool with the
target's page size and page count, addressed by the SAME page tables and page ids, so admission,
prefix caching and releases stay one mechanism: every program that writes or copies the target's
pages (the prefill, the prefix cache's page copies) does the same to the draft's, and params and
pools travel as (target, draft) pairs.

Per step and row the draft decodes k tokens autoregressively, each drawn from the draft's
distribution under the row's settings (the filtered softmax; one-hot at its argmax for greedy
rows, so greedy output equals plain decoding); the target then verifies them in one pass. The
draft's first call of a step feeds the last kept token and the pending one (t = 2): after a step
that kept every draft, the last of them was never fed to the draft, and this fills that slot
(otherwise it writes the same token again). A draft past the row's budget is not fed (segment 0:
written nowhere), so the draft writes only the pages its row holds.

A grammar's rows decode with the plain programs, which write only the target's pool: a row that
speculates after such a block has draft slots that were never written, which lowers how many of
its drafts are kept, never what it emits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lm.errors import UserError
from lm.infer.engine.pool import abstract_pool, init_pool, page_copier
from lm.infer.engine.spec_steps import row_probs, speculative_block
from lm.infer.engine.steps import decode_block, forward, prefill


def check_draft(target, draft, max_len: int, k: int) -> None:
    """The one-line refusals of a draft model that cannot propose for `target`."""
    if k < 1:
        raise UserError("engine: a draft model needs speculate >= 1 (tokens drafted per row and step)")
    t_vocab, d_vocab = target.spec.vocab_size, draft.spec.vocab_size
    if t_vocab != d_vocab:
        raise UserError(
            f"draft model: vocabulary of {d_vocab} tokens, the target's has {t_vocab}; "
            "a draft must use the target's tokenizer"
        )
    if max_len > draft.spec.max_seq_len:
        raise UserError(
            f"draft model: context of {draft.spec.max_seq_len} positions, generation needs {max_len}; "
            "give a shorter --max-model-len or a draft with a longer context"
        )


def _draw(keys, q, settings):
    """One token per row from its distribution q [S, V]; greedy rows take the argmax."""
    greedy = jnp.argmax(q, axis=-1).astype(jnp.int32)

    def sampled(_):
        drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
        return jnp.where(settings["temperature"] > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(settings["temperature"] > 0), sampled, lambda _: greedy, None)


def draft_proposals(draft, k: int, params, pool, s, feed, keys, table):
    """k drafts per row from the draft model (a proposer of spec_steps.speculative_block)."""
    rows, pos = s["tokens"].shape[0], s["pos"]
    n_valid = jnp.where(feed, jnp.minimum(k, s["left"] - 1), 0)
    last_kept = jnp.take_along_axis(s["history"], (pos - 1)[:, None], axis=1)[:, 0]
    fed = jnp.stack([last_kept, s["tokens"]], axis=1)
    seg = jnp.broadcast_to(feed[:, None], fed.shape).astype(jnp.int32)
    at = pos[:, None] - 1 + jnp.arange(2)
    logits, pool = forward(draft, params, pool, fed, seg, at, table, logits_at=jnp.ones(rows, jnp.int32))
    draw_keys = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, 1), k))(keys)  # [S, k, 2]

    def one(carry, i):
        logits, pool = carry
        q = row_probs(logits.astype(jnp.float32), s["settings"])[:, 0]
        token = _draw(draw_keys[:, i], q, s["settings"])
        seg = (feed & (i + 1 < n_valid)).astype(jnp.int32)[:, None]  # fed only if the next draft counts
        logits, pool = forward(draft, params, pool, token[:, None], seg, (pos + 1 + i)[:, None], table)
        return (logits, pool), (token, q)

    (logits, pool), (tokens, qs) = jax.lax.scan(one, (logits, pool), jnp.arange(k - 1))
    q_last = row_probs(logits.astype(jnp.float32), s["settings"])[:, 0]  # the k-th draft is not fed
    last = _draw(draw_keys[:, k - 1], q_last, s["settings"])
    drafts = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)
    return drafts, q, n_valid, pool


def _prefill(target, draft, params, pool, ids, seg, pos, table, last, keys, counts, settings):
    """steps.prefill of the target, the same chunks written into the draft's pool."""
    t_pool, tokens, logp = prefill(target, params[0], pool[0], ids, seg, pos, table, last, keys, counts, settings)
    _, d_pool = forward(draft, params[1], pool[1], ids, seg, pos, table, last)
    return (t_pool, d_pool), tokens, logp


def _plain(target, n, every, params, pool, state, table, limit):
    """steps.decode_block of the target (a grammar's rows); the draft's pool as it was."""
    t_pool, state, out, out_logp = decode_block(target, n, every, params[0], pool[0], state, table, limit)
    return (t_pool, pool[1]), state, out, out_logp


def _copy(copiers, pool, src, dst):
    return tuple(copy(p, src, dst) for copy, p in zip(copiers, pool))


def _in_place(model):
    return model.clone(paging=dataclasses.replace(model.paging, in_place=True))


@dataclasses.dataclass(frozen=True)
class DraftPrograms:
    """The engine's compiled programs with a draft model, over (target, draft) params and pools:
    prefill, copy (page copies), and decode[speculate] = (gathering, in place) as the engine's."""

    prefill: object
    copy: object
    decode: dict


@functools.lru_cache(maxsize=16)
def draft_programs(target, draft, n: int, every: int, k: int, slot_major: bool) -> DraftPrograms:
    """Every program of one (target, draft) pair, compiled once however many engines use them."""

    def programs(t, d):
        plain = jax.jit(functools.partial(_plain, t, n, every), donate_argnums=1)
        propose = functools.partial(draft_proposals, d, k)
        spec = jax.jit(functools.partial(speculative_block, t, propose, n, every, k), donate_argnums=1)
        return plain, spec

    plain, spec = programs(target, draft)
    plain_here, spec_here = programs(_in_place(target), _in_place(draft)) if slot_major else (None, None)
    copiers = (page_copier(target), page_copier(draft))
    return DraftPrograms(
        prefill=jax.jit(functools.partial(_prefill, target, draft), donate_argnums=1),
        copy=jax.jit(functools.partial(_copy, copiers), donate_argnums=0),
        decode={False: (plain, plain_here), True: (spec, spec_here)},
    )


def paired_pool(target, draft, place, abstract: bool = False):
    """The pools of the target and (if any) the draft: a pair with a draft, else the target's alone."""
    make = abstract_pool if abstract else init_pool
    pool = make(target, place)
    return pool if draft is None else (pool, make(draft, place))
