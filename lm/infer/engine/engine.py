"""The generation engine: a paged KV pool and continuous batching.

Requests wait in a queue; at every iteration the engine admits what fits (a free slot and the
pages the request can need), writes one chunk of every unfinished prompt (a prefill call), then
runs a block of decode steps for every running request (a decode call). A request leaves the batch
as soon as it ends (an end id, its token budget, a stop from its callback, or a cancel), its slot
and pages go to the next one, so no request waits for another's length. Shapes come from a few
buckets (rows, chunk width, page-table width), so the engine compiles a handful of programs once
and then only runs them. Every caller that generates (sampling, evaluation, RL rollouts, the
server) goes through here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import numpy as np

from lm.errors import UserError
from lm.infer.engine.draft_steps import check_draft, draft_programs, paired_pool
from lm.infer.engine.pages import PageAllocator
from lm.infer.engine.pool import Placement, page_copier
from lm.infer.engine.prefix import PrefixReuse, array_refs, same_arrays
from lm.infer.engine.request import MAX_EOS, EngineConfig, Request, check_prompt
from lm.infer.engine.rows import RowSettings
from lm.infer.engine.spec_steps import compiled_speculative
from lm.infer.engine.steps import NO_TOKEN, compiled, steps_between_checks
from lm.infer.sampling import SamplingParams
from lm.model.paged import Paging
from lm.model.transformer import unstack_layers

_unstack = jax.jit(unstack_layers)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def bucket(n: int, low: int, high: int) -> int:
    """The power of two (times `low`) at or above n, within [low, high]."""
    b = low
    while b < n and b < high:
        b *= 2
    return min(b, high)


class Engine:
    """Continuous batching over one model on one mesh (or one device). `step(params)` runs one
    iteration; `run(params, requests)` runs until those requests end (offline use);
    lm.infer.engine.service runs steps on a thread for a server. draft: a smaller model with the
    target's vocabulary that proposes the `config.speculate` drafts per row and step (default:
    prompt lookup); with one, every `params` given is a (target params, draft params) pair."""

    def __init__(
        self,
        model,
        *,
        max_len: int,
        config: EngineConfig = EngineConfig(),
        mesh=None,
        rules=(),
        unstack: bool | None = None,
        draft=None,
    ):
        if max_len > model.spec.max_seq_len:
            raise UserError(
                f"generation: max_len {max_len} exceeds the model's context ({model.spec.max_seq_len} positions)"
            )
        self.config, self.max_len = config, max_len
        self.place = Placement(mesh, rules)
        self.slots = self.place.rows(config.slots)
        ps = config.page_size
        self.table_width = -(-max_len // ps)
        # pages=0: every slot can hold a whole context, laid out slot by slot (PageAllocator)
        self.slot_major = config.pages == 0
        pages = self.slots * self.table_width if self.slot_major else config.pages
        self.paging = Paging(ps, pages, config.kv_cache)
        self.unstack = model.spec.cpu_kernels if unstack is None else unstack
        self.model = model.clone(paging=self.paging, unstacked=self.unstack)
        self.every = config.check_every or steps_between_checks()
        block = _round_up(max(config.decode_block, config.idle_block), self.every)
        # a decode call over every slot's whole table reads a slot-major pool in place
        in_place = model.clone(paging=dataclasses.replace(self.paging, in_place=True), unstacked=self.unstack)
        self._prefill, plain = compiled(self.model, block, self.every)
        self._programs = {False: (plain, compiled(in_place, block, self.every)[1] if self.slot_major else None)}
        if config.speculate:  # (a grammar's rows decode one token per step: the plain programs)
            spec = functools.partial(compiled_speculative, n=block, every=self.every, k=config.speculate)
            self._programs[True] = (spec(self.model), spec(in_place) if self.slot_major else None)
        self._prepare = _unstack if self.unstack else (lambda p: p)
        self.allocator = PageAllocator(pages, ps, self.table_width if self.slot_major else 0)
        self.prefix = PrefixReuse(ps) if config.prefix_cache else None
        self._copy_pages = page_copier(self.model)
        self.draft = None
        if draft is not None:
            self._use_draft(draft, block)
        self._prepared = None  # (weak references to the leaves of the params given, those params prepared)
        self.pool = None  # created on first use
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request | None] = [None] * self.slots
        self.device_s = 0.0  # time from each call's launch to its results on the host (the rest: device idle)
        self._reset_rows()

    def _use_draft(self, draft, block: int) -> None:
        """Drafts from a smaller model (lm.infer.engine.draft_steps): its own pool under the target's
        page tables; params and pools become (target, draft) pairs."""
        check_draft(self.model, draft, self.max_len, self.config.speculate)
        self.draft = draft.clone(paging=self.paging, unstacked=self.unstack)
        programs = draft_programs(self.model, self.draft, block, self.every, self.config.speculate, self.slot_major)
        self._prefill, self._copy_pages, self._programs = programs.prefill, programs.copy, programs.decode
        one = self._prepare

        def prepare(pair):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError("an engine with a draft model takes (target params, draft params)")
            return one(pair[0]), one(pair[1])

        self._prepare = prepare

    def _reset_rows(self):
        s = self.slots
        self.table = np.zeros((s, self.table_width), np.int32)
        self._device, self._tables = None, {}  # the rows as last sent (None: send them again)
        self.state = dict(
            tokens=np.zeros(s, np.int32),
            logp=np.zeros(s, np.float32),
            pos=np.zeros(s, np.int32),
            live=np.zeros(s, bool),
            count=np.zeros(s, np.int32),
            left=np.zeros(s, np.int32),
            keys=np.zeros((s, 2), np.uint32),
            eos=np.full((s, MAX_EOS), -1, np.int32),
        )
        if self.config.speculate:  # each row's tokens at their positions (drafts come from them), draft counts
            self.state |= dict(
                history=np.zeros((s, self.max_len + self.config.speculate + 1), np.int32),
                proposed=np.zeros(s, np.int32),
                accepted=np.zeros(s, np.int32),
                passes=np.zeros(s, np.int32),
            )
        self.settings = RowSettings.empty(s, self.model.spec.vocab_size)

    # ---- requests ----------------------------------------------------------------------------

    def check(self, prompt: list, sampling: SamplingParams, label: str = "prompt") -> None:
        """The one-line refusals of a request that cannot run."""
        check_prompt(self.max_len, prompt, sampling, label)
        need = self.allocator.pages_for(len(prompt) + sampling.max_new_tokens)
        if need > self.allocator.total:
            raise UserError(
                f"{label}: needs {need} pages of {self.config.page_size} tokens; the pool has {self.allocator.total}"
            )

    def add(self, request: Request) -> None:
        self.check(request.prompt, request.sampling)
        if len(request.eos) > MAX_EOS:
            raise UserError(f"generation: {len(request.eos)} end ids; at most {MAX_EOS}")
        if request.key is None:
            request.key = np.asarray(jax.random.PRNGKey(request.sampling.seed), np.uint32)
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.running)

    def run(self, params, requests: list[Request]) -> list[Request]:
        """Adds the requests and steps until they have all ended (params prepared per call)."""
        for r in requests:
            self.add(r)
        params = self.prepare(params)
        while any(r.finish is None for r in requests):
            self.step(params)
        return requests

    def prepare(self, params):
        """The params as the compiled steps take them (layers unstacked on the CPU kernel path);
        the same params give the same prepared object, so the prefix cache outlives a `run`."""
        if self._prepared is not None and same_arrays(self._prepared[0], params):
            return self._prepared[1]
        prepared = self._prepare(params)
        self._prepared = (array_refs(params), prepared) if prepared is not params else None
        return prepared

    # ---- one iteration -----------------------------------------------------------------------

    def step(self, params) -> None:
        """Admit, prefill one chunk of every unfinished prompt, decode one block."""
        if self.pool is None:
            self.pool = paired_pool(self.model, self.draft, self.place)
        if self.prefix is not None:
            self.prefix.belongs_to(params)
        for r in [r for r in self.running if r is not None and r.cancelled]:
            self._release(r, "cancelled")
        for _ in range(2):
            waited = self._admit()
            if self.prefix is not None and self.prefix.owed:
                src, dst = self.prefix.copies(self.paging.pages, bucket(self.prefix.owed, 8, 1 << 30))
                self.pool = self._copy_pages(self.pool, self.place.put(src), self.place.put(dst))
            prefilling = self._prefilling()
            if prefilling:
                self._prefill_chunks(params, prefilling)
            if not waited:
                break  # else once more: requests that waited for a prefix just written take it now
        if self.state["live"].any():
            self._decode_block(params)

    def _prefilling(self) -> list[Request]:
        """The running requests whose prompts are not all in the pool yet."""
        return [r for r in self.running if r is not None and r.written < len(r.prompt)]

    def _admit(self) -> bool:
        """Admits what fits; True if a request waits for a prefix a running prefill is writing."""
        for r in list(self.waiting):
            if r.cancelled:
                self.waiting.remove(r)
                self._finish(r, "cancelled")
        prefilling = self._prefilling()
        waited, filling = False, self.prefix.filling(prefilling) if self.prefix is not None else set()
        for r in list(self.waiting):
            if None not in self.running:
                break
            found = self.prefix.lookup(r, filling) if self.prefix is not None else []
            if found is None:
                waited = True
                continue  # a running prefill is writing more of its prefix: it waits for it to be cached
            slot = self.running.index(None)
            shared = () if self.slot_major else found  # slot-major: the prefix is copied into the slot's pages
            pages = self.allocator.take(len(r.prompt) + r.sampling.max_new_tokens, slot, shared)
            if pages is None:
                break  # the oldest admissible request waits for pages; the ones behind it keep their order
            self.waiting.remove(r)
            r.slot, r.pages = slot, pages
            if self.prefix is not None:
                self.prefix.take(r, found, filling)
            self.running[r.slot] = r
            if self.slot_major:  # the slot's own pages, all of them
                self.table[slot] = np.arange(slot * self.table_width, (slot + 1) * self.table_width)
            else:  # unused entries point at page 0
                self.table[slot] = 0
                self.table[slot, : len(pages)] = pages
            self._device, self._tables = None, {}
        return waited

    def _prefill_chunks(self, params, rows: list[Request]) -> None:
        cfg = self.config
        lens = [min(cfg.chunk, len(r.prompt) - r.written) for r in rows]
        n_rows = self.place.rows(bucket(len(rows), 1, self.slots))
        width = bucket(max(lens), 16, bucket(cfg.chunk, 16, 1 << 30))
        reach = max(r.written + n for r, n in zip(rows, lens))
        table_w = bucket(-(-reach // cfg.page_size), max(1, self.table_width // 8), self.table_width)
        ids, seg, pos = (np.zeros((n_rows, width), np.int32) for _ in range(3))
        table, last = np.zeros((n_rows, table_w), np.int32), np.zeros(n_rows, np.int32)
        keys, counts = np.zeros((n_rows, 2), np.uint32), np.zeros(n_rows, np.int32)
        settings = RowSettings.empty(n_rows, self.model.spec.vocab_size)
        for i, (r, n) in enumerate(zip(rows, lens)):
            ids[i, :n], seg[i, :n] = r.prompt[r.written : r.written + n], 1
            pos[i] = r.written + np.arange(width)
            table[i], last[i], keys[i] = self.table[r.slot, :table_w], n - 1, r.key
            settings.set(i, r.sampling, r.constraint.mask() if r.constraint is not None else None)
        put, start = self.place.put, time.perf_counter()
        self.pool, tokens, logp = self._prefill(
            params,
            self.pool,
            put(ids),
            put(seg),
            put(pos),
            put(table),
            put(last),
            put(keys),
            put(counts),
            jax.tree.map(put, settings.arrays()),
        )
        tokens, logp = self.place.host((tokens, logp))
        self.device_s += time.perf_counter() - start
        for i, (r, n) in enumerate(zip(rows, lens)):
            r.written += n
            if r.written == len(r.prompt):  # the prompt is in: its first token is pending
                if self.prefix is not None:
                    self.prefix.remember(r.prompt, r.pages)
                s = r.slot
                self.state["tokens"][s], self.state["logp"][s] = tokens[i], logp[i]
                self.state["pos"][s], self.state["live"][s] = len(r.prompt), True
                self.state["count"][s], self.state["left"][s] = 1, r.sampling.max_new_tokens
                self.state["keys"][s], self.state["eos"][s] = r.key, -1
                self.state["eos"][s, : len(r.eos)] = r.eos
                if "history" in self.state:
                    self.state["history"][s] = 0
                    self.state["history"][s, : len(r.prompt) + 1] = r.prompt + [int(tokens[i])]
                self.settings.set(s, r.sampling, self._advance(r, tokens[i]))
                self._device = None

    def _decode_block(self, params) -> None:
        cfg = self.config
        live = self.state["live"]
        host_work = self.waiting or self._prefilling()
        steps = cfg.decode_block if host_work else max(cfg.decode_block, cfg.idle_block)
        speculate = bool(cfg.speculate)
        if any(self.running[s].constraint is not None for s in np.flatnonzero(live)):
            steps, speculate = 1, False  # a grammar's mask holds for one token
        steps = _round_up(min(steps, int(self.state["left"][live].max())), self.every)
        reach = int((self.state["pos"][live] + min(steps * (1 + cfg.speculate * speculate), self.max_len)).max())
        table_w = bucket(-(-min(reach, self.max_len) // cfg.page_size), max(1, self.table_width // 8), self.table_width)
        table_w, decode = self.decode_program(table_w, speculate)
        put = self.place.put
        if self._device is None:  # rows changed on the host: send them; else the last call's output goes back in
            self._device = {k: put(v) for k, v in self.state.items()} | {
                "settings": jax.tree.map(put, self.settings.arrays())
            }
        if table_w not in self._tables:
            self._tables[table_w] = put(self.table[:, :table_w])
        start = time.perf_counter()
        self.pool, self._device, out, out_logp = decode(
            params, self.pool, self._device, self._tables[table_w], np.int32(steps)
        )
        rows = {k: v for k, v in self._device.items() if k != "settings"}
        new, out, out_logp = self.place.host((rows, out, out_logp))
        self.device_s += time.perf_counter() - start
        was_live = live.copy()
        self.state |= {k: np.array(v) for k, v in new.items()}
        for s in np.flatnonzero(was_live):
            r = self.running[s]
            keep = out[s] != NO_TOKEN
            ids, logps = out[s][keep], out_logp[s][keep]
            r.ids += ids.tolist()
            r.logps += logps.tolist()
            if r.constraint is not None and self.state["live"][s]:  # its next token is chosen: the mask after it
                self.settings.set(s, r.sampling, self._advance(r, self.state["tokens"][s]))
                self._device = None
            stop = bool(r.on_tokens(ids, logps)) if r.on_tokens is not None and len(ids) else False
            if r.cancelled or stop or not self.state["live"][s]:
                reason = (
                    "cancelled"
                    if r.cancelled
                    else "stop"
                    if stop
                    else ("eos" if r.ids and r.ids[-1] in r.eos else "length")
                )
                self._release(r, reason)

    @staticmethod
    def _advance(r: Request, token) -> np.ndarray | None:
        """The grammar of `r` (if any) past its newly chosen token: the tokens allowed after it."""
        if r.constraint is None:
            return None
        r.constraint.advance(int(token))
        return r.constraint.mask()

    def decode_program(self, table_w: int, speculate: bool = False):
        """(table width, compiled decode block) of a decode call whose rows reach `table_w` pages."""
        gathering, in_place = self._programs[speculate]
        if self.slot_major and table_w > self.table_width // 2:  # reading in place beats gathering most pages
            return self.table_width, in_place
        return table_w, gathering

    @property
    def acceptance(self) -> tuple[int, int]:
        """Speculation's drafts (proposed, accepted) over every request so far."""
        if "proposed" not in self.state:
            return 0, 0
        return int(self.state["proposed"].sum()), int(self.state["accepted"].sum())

    @property
    def verify_passes(self) -> int:
        """Speculation's target passes over every request so far (counted per row it fed)."""
        return int(self.state["passes"].sum()) if "passes" in self.state else 0

    def abstract_decode(self, params):
        """(compiled decode block, its abstract arguments) of a call over every slot's whole page
        table, for compiling ahead of time: params as given (ShapeDtypeStructs), nothing allocated."""
        width, decode = self.decode_program(self.table_width, bool(self.config.speculate))
        put = self.place.abstract
        state = {k: put(v) for k, v in self.state.items()} | {
            "settings": {k: put(v) for k, v in self.settings.arrays().items()}
        }
        limit = jax.ShapeDtypeStruct((), np.int32, sharding=self.place.sharding(()))
        pool = paired_pool(self.model, self.draft, self.place, abstract=True)
        return decode, (params, pool, state, put(self.table[:, :width]), limit)

    def _release(self, r: Request, reason: str) -> None:
        if self.prefix is not None and r.written == len(r.prompt):  # the fed tokens: all but the last emitted
            self.prefix.remember(r.prompt + r.ids[:-1], r.pages)
        self.state["live"][r.slot] = False
        self._device = None
        self.running[r.slot] = None
        self.allocator.give_back(r.pages)
        r.pages, r.slot = [], -1
        self._finish(r, reason)

    @staticmethod
    def _finish(r: Request, reason: str) -> None:
        r.finish = reason
        if r.on_done is not None:
            r.on_done(r)
        r.done.set()
