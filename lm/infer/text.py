"""Text in, text out: prompts through a tokenizer and a `Generator`, with stop strings and streaming."""

from __future__ import annotations

from typing import Callable

import numpy as np

from lm.errors import UserError
from lm.infer.generate import Generator

CHUNK = 16  # tokens decoded per jitted call when the host must look at the text in between


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
    so_far = [np.zeros(0, np.int32) for _ in encoded]
    shown = [0]

    def on_chunk(new_ids):
        stopped = []
        for r, ids in enumerate(new_ids):
            so_far[r] = np.concatenate([so_far[r], ids])
            if stop and _cut_at_stop(tokenizer, so_far[r], stop)[2]:
                stopped.append(r)
        if stream is not None:
            text = _cut_at_stop(tokenizer, so_far[0], stop)[0] if stop else tokenizer.decode(so_far[0])
            text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet
            if len(text) > shown[0]:
                stream(text[shown[0]:])
                shown[0] = len(text)
        return stopped

    chunked = bool(stop) or stream is not None
    result = generator(encoded, chunk=CHUNK if chunked else 0, on_chunk=on_chunk if chunked else None)
    out = []
    for ids, logp, finish in zip(result.ids, result.logprobs, result.finish):
        text, kept, hit = _cut_at_stop(tokenizer, ids, stop) if stop else (tokenizer.decode(ids), ids, False)
        out.append({"text": text, "ids": kept.tolist(), "logprobs": logp[: len(kept)].tolist(),
                    "finish_reason": "stop" if hit else finish})
    if stream is not None and len(out[0]["text"]) > shown[0]:  # what was held back at a chunk's edge
        stream(out[0]["text"][shown[0]:])
    return out
