"""What the engine takes: its configuration, a request, and the refusals of a prompt that cannot run."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np

from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.model.paged import KV_DTYPES

MAX_EOS = 4  # end ids a request may have (e.g. EOS and a chat template's end-of-turn)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: requests decoded together; pages: the pool's pages (0: enough for every slot to hold
    a whole context, so no request ever waits for pages); chunk: prompt tokens per row and prefill;
    decode_block: the most decode steps per call while the host has work (requests wait, prompts
    are being written, a grammar); idle_block: the most when it has none (fewer round trips; a
    server keeps it at decode_block so a request arriving mid-call waits less). A call also ends
    as soon as a row ends, so a freed slot is filled and an answer returned at once. check_every:
    decode steps between the device loop's checks whether to go on (0: the backend's default,
    lm.infer.engine.steps.steps_between_checks); speculate: drafts per row and step, by prompt
    lookup or by the engine's draft model (0: off; lm.infer.engine.spec_steps); kv_cache: "" (the
    compute dtype), "int8" or "fp8" pages (lm.model.paged); prefix_cache: reuse the pages of prompt
    prefixes already in the pool (lm.infer.engine.prefix)."""

    slots: int = 16
    page_size: int = 16
    pages: int = 0
    chunk: int = 256
    decode_block: int = 16
    idle_block: int = 256
    check_every: int = 0
    kv_cache: str = ""
    speculate: int = 0
    prefix_cache: bool = True

    def __post_init__(self):
        for name in ("slots", "page_size", "chunk", "decode_block", "idle_block"):
            if getattr(self, name) < 1:
                raise UserError(f"engine: {name}={getattr(self, name)}: expected at least 1")
        if self.speculate < 0:
            raise UserError(f"engine: speculate={self.speculate}: expected >= 0 (drafted tokens per step; 0 = off)")
        if self.check_every < 0:
            raise UserError(f"engine: check_every={self.check_every}: expected >= 0 (0 = the backend's default)")
        if self.kv_cache not in KV_DTYPES:
            raise UserError(
                f"engine: kv_cache={self.kv_cache!r}: expected one of int8, fp8 (or empty: the compute dtype)"
            )
        if self.pages < 0:
            raise UserError(f"engine: pages={self.pages}: expected >= 0 (0 = enough for every slot)")


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt to complete. on_tokens(new_ids, new_logps) -> True stops it (stop strings, a
    client gone); it is called from the engine's thread after every decode call that emitted."""

    prompt: list[int]
    sampling: SamplingParams
    eos: tuple[int, ...]
    key: np.ndarray | None = None  # uint32 [2]; default: PRNGKey(sampling.seed)
    on_tokens: Callable[[np.ndarray, np.ndarray], bool] | None = None
    on_done: Callable[["Request"], None] | None = None  # called once it has ended, from the engine's thread
    ids: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None  # "eos" | "length" | "stop" | "cancelled"
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    cancelled: bool = False
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    written: int = 0  # prompt tokens in the pool
    constraint: object | None = None  # a grammar's state (lm.infer.grammar.Constraint): what it may choose next
    page_keys: list | None = dataclasses.field(
        default=None, repr=False
    )  # its prompt's full pages' (lm.infer.engine.prefix)


def check_prompt(max_len: int, prompt, sampling: SamplingParams, label: str = "prompt") -> None:
    """The one-line refusals of a prompt that cannot be completed within `max_len` positions."""
    n, room = len(prompt), max_len - len(prompt)
    if n == 0:
        raise UserError(f"{label}: empty; give at least one token of text")
    if n >= max_len:
        raise UserError(
            f"{label}: {n} tokens, longer than the model's context of {max_len} positions "
            "(no room for a new token); shorten it"
        )
    if n + sampling.max_new_tokens > max_len:
        raise UserError(
            f"{label}: {n} tokens + max_new_tokens={sampling.max_new_tokens} exceed the context of "
            f"{max_len} positions; at most {room} new tokens fit after it (--max-new-tokens)"
        )
