"""Static-batch generation with a dense KV cache: the reference the engine (lm.infer.engine) is
checked against in the tests and measured against in bench/; nothing in lm/ generates through it.

Prefill, then decode in a jitted `lax.while_loop`.

A batch of prompts of different lengths is right-padded (segment id 0 on padding) and each
row decodes at its own positions, so no row waits on another's padding. Rows stop at EOS or
after `max_new_tokens`; the loop ends when every row has stopped. Without streaming or stop
strings the whole generation is one jitted call; with them, the loop runs in chunks and the
host checks the decoded text between chunks (rows it stops are masked in the next chunk).
The computation follows its inputs' shardings: params, cache and batch placed on a mesh
(`StaticGenerator(..., mesh=, rules=)`) decode sharded, as they train.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.errors import UserError
from lm.infer.generate import Generation, generation_context
from lm.infer.sampling import SamplingParams, choose
from lm.model.cache import cache_shardings, decode_step, init_cache
from lm.model.transformer import unstack_layers
from lm.sharding import batch_sharding, split_count, to_host

NO_TOKEN = -1


def _state_init(model, params, cache, ids, seg, pos, lengths, rng, sampling: SamplingParams):
    """Prefill the prompts and choose each row's first new token."""
    logits, cache = decode_step(model, params, cache, ids, seg, pos, logits_at=jnp.maximum(lengths - 1, 0))
    rng, key = jax.random.split(rng)
    tokens, logp = choose(key, logits[:, 0], sampling)
    b, n = ids.shape[0], sampling.max_new_tokens
    return dict(
        cache=cache,
        tokens=tokens,
        logp=logp,
        pos=lengths,
        done=lengths == 0,
        i=jnp.zeros((), jnp.int32),
        out=jnp.full((b, n), NO_TOKEN, jnp.int32),
        out_logp=jnp.zeros((b, n), jnp.float32),
        rng=rng,
    )


def _decode_until(model, params, state, limit, eos_id: tuple[int, ...], sampling: SamplingParams):
    """Records the pending token of every live row, feeds it, chooses the next; until `limit`
    tokens per row or every row is done."""

    def cond(s):
        return (s["i"] < limit) & ~jnp.all(s["done"])

    def body(s):
        live = ~s["done"]
        out = s["out"].at[:, s["i"]].set(jnp.where(live, s["tokens"], NO_TOKEN))
        out_logp = s["out_logp"].at[:, s["i"]].set(jnp.where(live, s["logp"], 0.0))
        done = (
            s["done"] | jnp.isin(s["tokens"], jnp.asarray(eos_id, jnp.int32)) | (s["i"] + 1 >= sampling.max_new_tokens)
        )
        feed = (~done).astype(jnp.int32)[:, None]  # finished rows write nothing
        logits, cache = decode_step(model, params, s["cache"], s["tokens"][:, None], feed, s["pos"][:, None])
        rng, key = jax.random.split(s["rng"])
        tokens, logp = choose(key, logits[:, 0], sampling)
        return dict(
            cache=cache,
            tokens=tokens,
            logp=logp,
            pos=s["pos"] + 1,
            done=done,
            i=s["i"] + 1,
            out=out,
            out_logp=out_logp,
            rng=rng,
        )

    return jax.lax.while_loop(cond, body, state)


def _host(x: jax.Array) -> np.ndarray:
    """The whole array on this host (with several processes, each holds only its shards)."""
    return np.asarray(to_host(x))


@functools.lru_cache(maxsize=16)
def _compiled(model, sampling: SamplingParams, eos_id: tuple[int, ...]):
    """The jitted prefill, decode-until and whole-generation functions of one model and setting,
    shared by every Generator of them (e.g. a base and a fine-tuned model: compiled once)."""
    init = jax.jit(functools.partial(_state_init, model, sampling=sampling))
    run = jax.jit(functools.partial(_decode_until, model, eos_id=eos_id, sampling=sampling), donate_argnums=1)

    def whole(params, cache, ids, seg, pos, lengths, rng):
        state = _state_init(model, params, cache, ids, seg, pos, lengths, rng, sampling)
        return _decode_until(model, params, state, sampling.max_new_tokens, eos_id, sampling)

    return init, run, jax.jit(whole)


class StaticGenerator:
    """Compiled static-batch generation for one model and sampling setting, on a mesh or one device.

    max_len: the cache length (prompt + new tokens must fit; default and upper bound: the model's
    context, see `generation_context`).
    unstack: decode with the layers as separate buffers (`Transformer.unstacked`); default: on
    the CPU kernel path, where slicing stacked layers on every step copies them. It costs one
    copy of the params per call.
    """

    def __init__(
        self,
        model,
        params,
        sampling: SamplingParams,
        *,
        eos_id: int | tuple[int, ...],
        max_len: int | None = None,
        mesh=None,
        rules=(),
        unstack: bool | None = None,
    ):
        eos_id = tuple(int(i) for i in eos_id) if isinstance(eos_id, (tuple, list)) else (int(eos_id),)
        self.sampling, self.eos_id = sampling, eos_id
        self.unstack = model.spec.cpu_kernels if unstack is None else unstack
        self.model = model.clone(unstacked=True) if self.unstack else model
        model = self.model
        self._prepare = jax.jit(unstack_layers) if self.unstack else (lambda p: p)
        self.max_len = max_len or generation_context(model.spec)
        if self.max_len > model.spec.max_seq_len:
            raise UserError(
                f"generation: max_len {self.max_len} exceeds the model's context ({model.spec.max_seq_len} positions)"
            )
        self.mesh, self.rules = mesh, rules
        self.params = params
        self._init, self._run, self._whole = _compiled(model, sampling, eos_id)

    # ---- batches ---------------------------------------------------------------------------

    def _rows(self, n: int) -> int:
        """Rows to run: n rounded up to a multiple of the mesh's batch shards."""
        if self.mesh is None:
            return n
        shards = split_count(self.mesh, batch_sharding(self.mesh, self.rules).spec[0])
        return -(-n // shards) * shards

    def check(self, prompts: list) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise UserError(f"prompt {i}: empty; give at least one token of text")
            if len(p) >= self.max_len:
                raise UserError(
                    f"prompt {i}: {len(p)} tokens, longer than the model's context of {self.max_len} "
                    "positions (no room for a new token); shorten it"
                )
            if len(p) + self.sampling.max_new_tokens > self.max_len:
                room = self.max_len - len(p)
                raise UserError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens={self.sampling.max_new_tokens} "
                    f"exceed the context of {self.max_len} positions; at most {room} new tokens fit "
                    "after it (--max-new-tokens)"
                )

    def _inputs(self, prompts: list, pad_to: int = 0):
        b, tp = self._rows(len(prompts)), max(max(len(p) for p in prompts), pad_to)
        ids, seg = np.zeros((b, tp), np.int32), np.zeros((b, tp), np.int32)
        lengths = np.zeros((b,), np.int32)
        for r, p in enumerate(prompts):
            ids[r, : len(p)], seg[r, : len(p)], lengths[r] = p, 1, len(p)
        pos = np.tile(np.arange(tp, dtype=np.int32), (b, 1))
        arrays = [ids, seg, pos]
        if self.mesh is None:
            cache = init_cache(self.model, b, self.max_len)
            return cache, [jnp.asarray(a) for a in arrays], jnp.asarray(lengths), lengths
        sh = batch_sharding(self.mesh, self.rules)
        rows = NamedSharding(self.mesh, PartitionSpec(sh.spec[0]))
        cache = init_cache(
            self.model, b, self.max_len, cache_shardings(self.model, b, self.max_len, self.mesh, self.rules)
        )
        return cache, [jax.device_put(a, sh) for a in arrays], jax.device_put(lengths, rows), lengths

    # ---- generation ------------------------------------------------------------------------

    def __call__(self, prompts: list, chunk: int = 0, on_chunk=None, rng=None, pad_to: int = 0) -> Generation:
        """prompts: token id lists. chunk > 0: decode `chunk` tokens per call and call
        `on_chunk(new_ids_per_row) -> rows to stop` between calls (streaming, stop strings).
        rng: the sampling key (default: from sampling.seed; RL passes a fresh one per step).
        pad_to: pad prompts to at least this width, so batches of other prompts reuse the compiled call."""
        self.check(prompts)
        cache, (ids, seg, pos), lengths, true_lengths = self._inputs([list(p) for p in prompts], pad_to)
        rng = jax.random.PRNGKey(self.sampling.seed) if rng is None else rng
        params = self._prepare(self.params)
        n = len(prompts)
        stopped = np.zeros(len(true_lengths), bool)
        if chunk <= 0:
            state = self._whole(params, cache, ids, seg, pos, lengths, rng)
        else:
            state = self._init(params, cache, ids, seg, pos, lengths, rng)
            limit, seen = 0, 0
            while True:
                limit = min(limit + chunk, self.sampling.max_new_tokens)
                state = self._run(params, state, limit)
                out = _host(state["out"])
                stop_rows = on_chunk([row[seen:limit][row[seen:limit] != NO_TOKEN] for row in out[:n]]) or ()
                seen = limit
                for r in stop_rows:
                    stopped[r] = True
                if stop_rows:
                    state["done"] = state["done"] | jnp.asarray(stopped)
                if limit >= self.sampling.max_new_tokens or bool(np.all(_host(state["done"])[:n])):
                    break
        return self._result(state, n, stopped)

    def _result(self, state, n: int, stopped) -> Generation:
        out, logp = _host(state["out"]), _host(state["out_logp"])
        ids, logps, finish = [], [], []
        for r in range(n):
            keep = out[r] != NO_TOKEN
            ids.append(out[r][keep])
            logps.append(logp[r][keep])
            if stopped[r]:
                finish.append("stop")
            elif len(ids[-1]) and ids[-1][-1] in self.eos_id:
                finish.append("eos")
            else:
                finish.append("length")
        return Generation(ids, logps, finish)
