"""The server's backend: every request joins one continuous-batching engine (lm.infer.engine) that
runs on its own thread; each request's text streams back as its tokens arrive."""

from __future__ import annotations

import queue
from typing import Iterator

import jax
import numpy as np

from lm.data import chat
from lm.data.chat import ChatTemplate
from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.engine.service import EngineService
from lm.infer.generate import generation_context
from lm.infer.grammar import vocabulary
from lm.infer.sampling import SamplingParams
from lm.infer.serve.backend import FINISH, Delta
from lm.infer.serve.metrics import Load
from lm.infer.serve.tools import ToolSyntax
from lm.infer.stops import StopWatch

DRAFT_K = 4  # tokens a draft model proposes per request and step when --speculate is not given


class EngineStream:
    """One request's Deltas: text that can no longer change (never a stop string or the start of
    one, never half a character), then a last Delta with the finish reason."""

    def __init__(
        self, tokenizer, prompt_ids: list[int], sampling: SamplingParams, stop: tuple[str, ...], eos: tuple[int, ...]
    ):
        self.watch, self.prompt_tokens = StopWatch(tokenizer, stop), len(prompt_ids)
        self.deltas: queue.Queue = queue.Queue()
        # the key `lm sample --seed` gives its first prompt: the same seed draws the same tokens
        key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(sampling.seed), 0), np.uint32)
        self.request = Request(
            list(prompt_ids), sampling, eos, key=key, on_tokens=self._on_tokens, on_done=self._on_done
        )

    def _on_tokens(self, ids, logps) -> bool:
        self.deltas.put(Delta(self.watch.add(ids), [int(t) for t in ids], None))
        return self.watch.hit

    def _on_done(self, request: Request) -> None:
        self.deltas.put(Delta(self.watch.rest(), [], FINISH[request.finish]))

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self.deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.request.cancelled = True


class Keeping:
    """A tokenizer whose decode writes the `keep` special ids as their text (tool-call markers
    that plain decoding drops), each piece between them decoded as usual."""

    def __init__(self, tokenizer, keep: dict[int, str]):
        self.tokenizer, self.keep = tokenizer, keep

    def decode(self, ids) -> str:
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        cuts = [j for j, t in enumerate(ids) if t in self.keep]
        pieces, start = [], 0
        for j in cuts:
            pieces += [self.tokenizer.decode(ids[start:j]), self.keep[ids[j]]]
            start = j + 1
        return "".join(pieces) + self.tokenizer.decode(ids[start:])


class EngineBackend:
    """A loaded model on its mesh behind one engine. Every request ends at the chat template's stop
    ids (EOS, and the end-of-turn marker when the tokenizer has it as a control token)."""

    def __init__(self, session, model_name: str, context: int | None = None, config: EngineConfig = EngineConfig()):
        self.tokenizer, self.model_name = session.tokenizer, model_name
        most = generation_context(session.built.spec)
        if context is not None and not 0 < context <= most:
            raise UserError(f"--max-model-len {context}: expected 1 to {most} (the model's context)")
        self.context = context or most
        self.template = ChatTemplate.for_tokenizer(self.tokenizer)
        specials = self.tokenizer.special_tokens() if hasattr(self.tokenizer, "special_tokens") else {}
        self.tool_syntax = ToolSyntax.of(getattr(self.template, "source", None), specials)
        built = session.built
        self.vocab_size = built.spec.vocab_size
        engine = Engine(
            built.module,
            max_len=self.context,
            config=config,
            mesh=built.mesh,
            rules=built.rules,
            draft=session.draft_module,
        )
        self.service = EngineService(engine, session.engine_params)

    def prompt_ids(self, prompt=None, messages=None, tools=None):
        if messages is None:
            return [int(t) for t in self.tokenizer.encode(prompt)], ()
        return chat.prompt_ids(self.template, messages, tools), tuple(self.template.stop_strings)

    def submit(self, prompt_ids, sampling, stop, grammar=None, keep=None) -> EngineStream:
        eos = tuple(self.template.stop_ids)
        tokenizer = Keeping(self.tokenizer, keep) if keep else self.tokenizer
        stream = EngineStream(tokenizer, prompt_ids, sampling, tuple(stop), eos)
        if grammar is not None:
            stream.request.constraint = vocabulary(self.tokenizer, self.vocab_size, eos).constraint(grammar)
        self.service.submit(stream.request)
        return stream

    def load(self) -> Load:
        engine = self.service.engine
        running = sum(r is not None for r in list(engine.running))
        cache = engine.prefix
        return Load(
            waiting=self.service.waiting,
            running=running,
            prefix_hit_rate=cache.hit_rate if cache is not None else 0.0,
            prefix_hit_tokens=cache.stats["hit_tokens"] if cache is not None else 0,
        )

    def shutdown(self, cancel: bool) -> None:
        self.service.shutdown(cancel)


def make_backend(loaded, args) -> EngineBackend:
    """The backend `lm serve` runs: a loaded model and the command's flags (quantize, slots,
    page_size, max_model_len, model_name; kv_cache, speculate, draft and no_prefix_cache when given).
    A draft model speculates DRAFT_K tokens per step unless --speculate says how many."""
    from lm.infer.session import Session, load_draft

    draft = getattr(args, "draft", None)
    speculate = getattr(args, "speculate", 0) or (DRAFT_K if draft else 0)

    # a request arriving mid-call waits for the call to end: every call is a short block
    config = EngineConfig(
        slots=args.slots,
        page_size=args.page_size,
        idle_block=16,
        kv_cache=getattr(args, "kv_cache", ""),
        speculate=speculate,
        prefix_cache=not getattr(args, "no_prefix_cache", False),
    )
    session = Session(loaded, quantize=args.quantize, draft=load_draft(draft) if draft else None)
    return EngineBackend(session, args.model_name, args.max_model_len, config)
