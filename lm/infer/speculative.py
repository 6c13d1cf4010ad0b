"""Speculative decoding at batch 1: a cheap draft proposes k tokens, the target scores them all in
one step of the engine over its paged KV pool and keeps the prefix it agrees with.

Drafts: a smaller model with the target's vocabulary (`DraftModel`), decoding autoregressively
with its own cache; or prompt lookup (`NGRAM`, `spec_verify.ngram_drafts`): the tokens that
followed the most recent earlier occurrence of the context's last 3 (then 2, then 1) tokens;
without a match the step is a plain one-token step.

One step, jitted whole: draft k tokens, feed the pending token and the k drafts to the target as
ONE chunk (t = k+1) through the engine's step function (`lm.infer.engine.steps.forward`) over a
paged pool (one page holding the whole context), keep a prefix with the rejection sampler
(`spec_verify.accept_drafts`), emit it and the token that follows. The host only loops over calls
that each run many steps (one call per prompt unless it streams). A token's cache slot is its
position and a query sees only slots at or before its own, so the slots of rejected drafts need
no rollback: they are written again before any query can see them. The draft model's first
call of a step feeds the last kept token and the pending one (t = 2), so its cache is whole
however many drafts were kept.

Greedy output equals the target's own greedy decoding (`Generator`); sampled output is
distributed as the target's under the same SamplingParams. Batch 1 only: prompts are decoded one
after another, each on one device.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.errors import UserError
from lm.infer.engine.pool import Placement, init_pool
from lm.infer.engine.steps import forward
from lm.infer.generate import Generation, generation_context
from lm.infer.sampling import SamplingParams, choose
from lm.infer.spec_verify import accept_drafts, draw, ngram_drafts, probs_of
from lm.model.cache import decode_step, init_cache
from lm.model.paged import Paging
from lm.model.params import check_fits
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, abstract_params, unstack_layers
from lm.sharding import place_leaf

NGRAM = "ngram"
MIN_PREFILL = 16  # prompts are padded to a power of two (at least this) so few prefills compile
STREAM_STEPS = 4  # steps per call when the host looks at the new tokens in between


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
    """A draft: a (smaller) model with the target's tokenizer, and its params."""

    model: Transformer
    params: dict


@dataclasses.dataclass
class SpeculativeGeneration(Generation):
    """A Generation and how speculation went, over all its prompts: drafts proposed and kept,
    and target calls (the prefill included; plain decoding makes one per token)."""

    proposed: int
    accepted: int
    target_calls: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def tokens_per_call(self) -> float:
        return sum(len(i) for i in self.ids) / max(self.target_calls, 1)


def on_one_device(loaded) -> tuple[Transformer, dict]:
    """A loaded model (lm.store.load.Loaded) as (module, params on this process's first device):
    batch 1 needs no mesh."""
    model = Transformer(ModelSpec.from_config(loaded.config.model))
    abstract = nn.unbox(abstract_params(model))
    check_fits(abstract, loaded.params, loaded.source, complete=True)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return model, jax.tree.map(lambda x: place_leaf(x, device), loaded.params)


# ---- the jitted pieces ------------------------------------------------------------------------


def _prefill(
    target, draft, sampling, k, max_len, t_params, d_params, t_cache, d_cache, ids, length, rng, index, eos_id, max_new
):
    """Both caches filled with the prompt ids [1, P] (its first `length` real), and the first token,
    drawn with fold_in(rng, index). The end ids [n] and max_new_tokens ride in the state as
    values: one compile serves them all."""
    p = ids.shape[1]
    seg = (jnp.arange(p) < length).astype(jnp.int32)[None]
    pos, at = jnp.arange(p, dtype=jnp.int32)[None], (length - 1)[None]
    logits, t_cache = forward(target, t_params, t_cache, ids, seg, pos, _one_page(), logits_at=at)
    if draft is not None:
        _, d_cache = decode_step(draft, d_params, d_cache, ids, seg, pos, logits_at=at)
    rng, key = jax.random.split(jax.random.fold_in(rng, index))
    token, logp = choose(key, logits[:, 0], sampling)
    size = max_len + k + 1  # room for a whole step's tokens past the last position
    context = jnp.zeros((size,), jnp.int32).at[:p].set(ids[0] * seg[0]).at[length].set(token[0])
    done = jnp.isin(token[0], eos_id) | (max_new <= 1)
    zero = jnp.zeros((), jnp.int32)
    return dict(
        t_cache=t_cache,
        d_cache=d_cache,
        context=context,
        logp=jnp.zeros((size,), jnp.float32).at[length].set(logp[0]),
        pos=length,
        start=length,
        done=done,
        proposed=zero,
        accepted=zero,
        calls=zero + 1,
        rng=rng,
        eos_id=eos_id,
        max_new=max_new,
    )


def _draft_tokens(draft, sampling, k, max_len, d_params, d_cache, context, pos, key):
    """k drafts from the draft model and the distributions they were drawn from ([k], [k, V])."""
    fed = jax.lax.dynamic_slice(context, (pos - 1,), (2,))[None]  # the last kept token and the pending one
    logits, d_cache = decode_step(
        draft,
        d_params,
        d_cache,
        fed,
        jnp.ones_like(fed),
        (pos - 1 + jnp.arange(2))[None],
        logits_at=jnp.ones((1,), jnp.int32),
    )
    keys = jax.random.split(key, k)

    def one(carry, i):
        logits, cache = carry
        q = probs_of(logits[0, 0], sampling)
        token = draw(keys[i], q, sampling.greedy)
        at = pos + 1 + i  # past the context (drafts beyond the budget): segment 0, written nowhere
        seg = (at < max_len).astype(jnp.int32)[None, None]
        at = jnp.minimum(at, max_len - 1)[None, None]
        logits, cache = decode_step(draft, d_params, cache, token[None, None], seg, at)
        return (logits, cache), (token, q)

    (logits, d_cache), (tokens, qs) = jax.lax.scan(one, (logits, d_cache), jnp.arange(k - 1))
    q_last = probs_of(logits[0, 0], sampling)  # the k-th draft is fed next step, beside the pending token
    tokens = jnp.concatenate([tokens, draw(keys[k - 1], q_last, sampling.greedy)[None]])
    return tokens, jnp.concatenate([qs, q_last[None]]), d_cache


def _one_page():
    """The target's page table: its one row owns the pool's one page (the whole context)."""
    return jnp.zeros((1, 1), jnp.int32)


def _target_logits(target, k, max_len, t_params, t_cache, context, pos, drafts, n_valid, may_skip: bool):
    """The target's logits [k+1, V] after the pending token and each draft: one call over all of
    them, or (may_skip: n-gram drafts, often without a match) a plain one-token step, its logits
    repeated, when no draft counts."""

    def verify(cache):
        tokens = jnp.concatenate([context[pos][None], drafts])[None]
        at = pos + jnp.arange(k + 1)
        logits, cache = forward(
            target,
            t_params,
            cache,
            tokens,
            (at < max_len).astype(jnp.int32)[None],
            jnp.minimum(at, max_len - 1)[None],
            _one_page(),
        )
        return logits[0], cache

    def plain(cache):
        one = jnp.ones((1, 1), jnp.int32)
        logits, cache = forward(target, t_params, cache, context[pos][None, None], one, pos[None, None], _one_page())
        return jnp.broadcast_to(logits[0], (k + 1, logits.shape[-1])), cache

    return jax.lax.cond(n_valid > 0, verify, plain, t_cache) if may_skip else verify(t_cache)


def _step(target, draft, sampling, k, max_len, t_params, d_params, s):
    """Draft, verify, keep a prefix, emit: one speculative step of the state `s`."""
    rng, key_draft, key_accept = jax.random.split(s["rng"], 3)
    pos, context = s["pos"], s["context"]
    remaining = s["max_new"] - (pos + 1 - s["start"])  # tokens still to emit (>= 1)
    budget = jnp.minimum(k, remaining - 1)  # the drafts that could be emitted, the next token aside
    if draft is None:
        drafts, found = ngram_drafts(context, pos + 1, k)
        q, d_cache, n_valid = jax.nn.one_hot(drafts, target.spec.vocab_size), s["d_cache"], jnp.minimum(found, budget)
    else:
        drafts, q, d_cache = _draft_tokens(draft, sampling, k, max_len, d_params, s["d_cache"], context, pos, key_draft)
        n_valid = budget
    logits, t_cache = _target_logits(
        target, k, max_len, t_params, s["t_cache"], context, pos, drafts, n_valid, may_skip=draft is None
    )
    n_acc, following = accept_drafts(key_accept, probs_of(logits, sampling), q, drafts, n_valid, sampling.greedy)
    emitted = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[n_acc].set(following)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), emitted[:, None], axis=-1)[:, 0]
    i = jnp.arange(k + 1)
    eos = jnp.isin(emitted, s["eos_id"]) & (i <= n_acc)
    count = jnp.where(jnp.any(eos), jnp.argmax(eos) + 1, n_acc + 1)
    new_pos = pos + count  # the slots past it hold rejected drafts: written again before they are seen
    return s | dict(
        t_cache=t_cache,
        d_cache=d_cache,
        rng=rng,
        pos=new_pos,
        context=jax.lax.dynamic_update_slice(context, emitted, (pos + 1,)),
        logp=jax.lax.dynamic_update_slice(s["logp"], logp, (pos + 1,)),
        done=jnp.any(eos) | (new_pos + 1 - s["start"] >= s["max_new"]),
        proposed=s["proposed"] + n_valid,
        accepted=s["accepted"] + n_acc,
        calls=s["calls"] + 1,
    )


def _run(target, draft, sampling, k, max_len, t_params, d_params, state, steps):
    """Speculative steps until the generation is done or `steps` steps have run."""
    step = functools.partial(_step, target, draft, sampling, k, max_len, t_params, d_params)
    state, _ = jax.lax.while_loop(
        lambda c: ~c[0]["done"] & (c[1] < steps), lambda c: (step(c[0]), c[1] + 1), (state, jnp.zeros((), jnp.int32))
    )
    return state


@functools.lru_cache(maxsize=16)
def _compiled(target, draft, sampling: SamplingParams, k: int, max_len: int):
    """The jitted start (prefill, then up to `steps` steps: one call when nobody looks in between)
    and run (more steps) of one (target, draft, filters), shared by every decoder of them
    (whatever their end ids, max_new_tokens and seed)."""
    static = (target, draft, sampling, k, max_len)

    def start(t_params, d_params, t_cache, d_cache, ids, length, rng, index, eos_id, max_new, steps):
        state = _prefill(*static, t_params, d_params, t_cache, d_cache, ids, length, rng, index, eos_id, max_new)
        return _run(*static, t_params, d_params, state, steps)

    return (jax.jit(start, donate_argnums=(2, 3)), jax.jit(functools.partial(_run, *static), donate_argnums=2))


# ---- the host loop ----------------------------------------------------------------------------


class SpeculativeDecoder:
    """Compiled speculative decoding of one target, draft (a `DraftModel` or NGRAM), k and
    sampling setting. Called like a `Generator` (prompts as token id lists, on_tokens for
    streaming and stop strings), it decodes the prompts one after another at batch 1."""

    def __init__(
        self,
        model,
        params,
        sampling: SamplingParams,
        *,
        draft,
        k: int = 4,
        eos_id: int | tuple[int, ...],
        max_len: int | None = None,
    ):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise UserError(f"speculative decoding: k={k!r}: expected an integer >= 1 (drafted tokens per step)")
        self.k, self.sampling = int(k), sampling
        self.eos_id = tuple(int(i) for i in eos_id) if isinstance(eos_id, (tuple, list)) else (int(eos_id),)
        self.target, self.t_params = _decoding(model, params)
        self.max_len = max_len or generation_context(model.spec)
        if draft == NGRAM:
            self.draft, self.d_params = None, {}
        elif isinstance(draft, DraftModel):
            t_vocab, d_vocab = model.spec.vocab_size, draft.model.spec.vocab_size
            if t_vocab != d_vocab:
                raise UserError(
                    f"draft model: vocabulary of {d_vocab} tokens, the target's has {t_vocab}; "
                    "a draft must use the target's tokenizer"
                )
            self.draft, self.d_params = _decoding(draft.model, draft.params)
            self.max_len = min(self.max_len, draft.model.spec.max_seq_len)
        else:
            raise UserError(f"speculative decoding: draft={draft!r}: expected a draft model or {NGRAM!r}")
        if self.max_len > model.spec.max_seq_len:
            raise UserError(
                f"generation: max_len {self.max_len} exceeds the model's context ({model.spec.max_seq_len} positions)"
            )
        # the target's KV cache: the engine's paged pool, one page holding the whole context
        self.target = self.target.clone(paging=Paging(self.max_len, 1, in_place=True))
        filters = dataclasses.replace(sampling, max_new_tokens=1, seed=0)  # what the compiled steps depend on
        self._start, self._run = _compiled(self.target, self.draft, filters, self.k, self.max_len)
        self._eos, self._n = jnp.asarray(self.eos_id, jnp.int32), jnp.int32(sampling.max_new_tokens)
        self._rng = jax.random.PRNGKey(sampling.seed)

    def check(self, prompts: list) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise UserError(f"prompt {i}: empty; give at least one token of text")
            if len(p) + self.sampling.max_new_tokens > self.max_len:
                room = max(self.max_len - len(p), 0)
                raise UserError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens={self.sampling.max_new_tokens} "
                    f"exceed the context of {self.max_len} positions; at most {room} new tokens fit "
                    "after it (--max-new-tokens)"
                )

    def __call__(self, prompts: list, rng=None, on_tokens: list | None = None) -> SpeculativeGeneration:
        """prompts: token id lists. rng: the sampling key (default: from sampling.seed); prompt r
        draws from fold_in(rng, r), so its tokens do not depend on the others. on_tokens: per
        prompt, called with each piece of new ids and log-probs (every STREAM_STEPS steps);
        returning True stops that prompt ('stop')."""
        self.check(prompts)
        rng = self._rng if rng is None else rng
        result = SpeculativeGeneration([], [], [], 0, 0, 0)
        for r, prompt in enumerate(prompts):
            steps = self.sampling.max_new_tokens if on_tokens is None else STREAM_STEPS
            state = self._start(
                self.t_params, self.d_params, *self._caches(), *self._ids(prompt), rng, r, self._eos, self._n, steps
            )
            stopped = False
            if on_tokens is None:
                host = _on_host(state)
            else:
                seen = len(prompt)
                while True:
                    host = _on_host(state)
                    end = int(host["pos"]) + 1
                    stopped = bool(on_tokens[r](host["context"][seen:end], host["logp"][seen:end]))
                    seen = end
                    if stopped or host["done"]:
                        break
                    state = self._run(self.t_params, self.d_params, state, STREAM_STEPS)
            self._collect(result, host, stopped)
        return result

    def _caches(self):
        d_cache = {} if self.draft is None else init_cache(self.draft, 1, self.max_len)
        return init_pool(self.target, Placement()), d_cache

    def _ids(self, prompt):
        width = min(max(MIN_PREFILL, 1 << (len(prompt) - 1).bit_length()), self.max_len)
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(prompt)] = prompt
        return jnp.asarray(ids), jnp.asarray(len(prompt), jnp.int32)

    def _collect(self, result: SpeculativeGeneration, state: dict, stopped: bool) -> None:
        start, end = int(state["start"]), int(state["pos"]) + 1
        ids = state["context"][start:end]
        result.ids.append(ids)
        result.logprobs.append(state["logp"][start:end])
        result.finish.append("stop" if stopped else "eos" if ids[-1] in self.eos_id else "length")
        result.proposed += int(state["proposed"])
        result.accepted += int(state["accepted"])
        result.target_calls += int(state["calls"])


def _on_host(state: dict) -> dict:
    """What the host reads of a state, fetched in one transfer (the caches stay)."""
    return jax.device_get({k: v for k, v in state.items() if not k.endswith("cache")})


def _decoding(model, params):
    """The module and params to decode with: layers unstacked on the CPU kernel path (slicing
    stacked layers out on every step copies them on XLA:CPU; one copy of the params instead)."""
    if model.spec.cpu_kernels:
        return model.clone(unstacked=True), jax.jit(unstack_layers)(params)
    return model, params
