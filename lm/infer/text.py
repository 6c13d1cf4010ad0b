"""Text in, text out: prompts through a tokenizer and a `Generator`, with stop strings and streaming."""

from __future__ import annotations

from typing import Callable

import numpy as np

from lm.errors import UserError
from lm.infer.generate import Generator

def _cut_at_stop(tokenizer, ids: np.ndarray, stop: tuple[str, ...]) -> tuple[str, np.ndarray, bool]:
    """(text before the first stop string, the fewest ids whose text holds it, whether one was found)."""
    text = tokenizer.decode(ids)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not hits:
        return text, ids, False
    cut = min(hits)
    k = next(k for k in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:k])) > cut and
             any(s in tokenizer.decode(ids[:k]) for s in stop))
    return text[:cut], ids[:k], True


def complete(generator: Generator, tokenizer, prompts: list[str], stop: tuple[str, ...] = (),
             stream: Callable[[str], None] | None = None) -> list[dict]:
    """Completions of `prompts`: {'text', 'ids', 'logprobs', 'finish_reason'} per prompt.

    stop: strings that end a completion (not included in its text). stream: called with each
    new piece of the first prompt's text as it is generated.
    """
    encoded = []
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"prompt {i}: empty; give at least one character of text")
        encoded.append([int(t) for t in tokenizer.encode(p)])
    return complete_ids(generator, tokenizer, encoded, stop, stream)


def complete_ids(generator: Generator, tokenizer, encoded: list, stop: tuple[str, ...] = (),
                 stream: Callable[[str], None] | None = None) -> list[dict]:
    """`complete` for prompts already tokenized (e.g. rendered by the chat template)."""
    watchers = [StopWatch(tokenizer, stop, stream if r == 0 else None) for r in range(len(encoded))]
    watched = bool(stop) or stream is not None
    result = generator(encoded, on_tokens=[w.add for w in watchers] if watched else None)
    out = []
    for ids, logp, finish, watch in zip(result.ids, result.logprobs, result.finish, watchers):
        text, kept, hit = _cut_at_stop(tokenizer, ids, stop) if stop else (tokenizer.decode(ids), ids, False)
        out.append({"text": text, "ids": kept.tolist(), "logprobs": logp[: len(kept)].tolist(),
                    "finish_reason": "stop" if hit else finish})
        watch.flush(text)
    return out


class StopWatch:
    """Follows one completion's new tokens: says when its text holds a stop string, and streams
    the text that is final (before any stop string, whole characters only)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], stream: Callable[[str], None] | None = None):
        self.tokenizer, self.stop, self.stream = tokenizer, stop, stream
        self.ids, self.shown = np.zeros(0, np.int32), 0

    def add(self, new_ids, new_logps=None) -> bool:
        """Takes new ids; True when a stop string has appeared."""
        self.ids = np.concatenate([self.ids, np.asarray(new_ids, np.int32)])
        text, _, hit = _cut_at_stop(self.tokenizer, self.ids, self.stop) if self.stop else \
            (self.tokenizer.decode(self.ids), None, False)
        if self.stream is not None:
            self.flush(text.rstrip("\ufffd"))  # a character whose bytes are not all there yet
        return hit

    def flush(self, text: str) -> None:
        """Streams what of `text` was not shown yet (the final text, at the end)."""
        if self.stream is not None and len(text) > self.shown:
            self.stream(text[self.shown:])
            self.shown = len(text)
