"""Text in, text out: prompts through a tokenizer and a `Generator`, with stop strings and streaming."""

from __future__ import annotations

from typing import Callable

from lm.errors import UserError
from lm.infer.generate import Generator
from lm.infer.stops import StopWatch, cut_at_stop, ids_through_stop


def complete(
    generator: Generator,
    tokenizer,
    prompts: list[str],
    stop: tuple[str, ...] = (),
    stream: Callable[[str], None] | None = None,
) -> list[dict]:
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


def complete_ids(
    generator: Generator,
    tokenizer,
    encoded: list,
    stop: tuple[str, ...] = (),
    stream: Callable[[str], None] | None = None,
) -> list[dict]:
    """`complete` for prompts already tokenized (e.g. rendered by the chat template). The stream
    gets the text the stop watcher has made final (lm.infer.stops), as `lm serve` streams it."""
    watchers = [StopWatch(tokenizer, stop) for _ in encoded]
    watched = bool(stop) or stream is not None
    result = generator(
        encoded, on_tokens=[_follow(w, stream if r == 0 else None) for r, w in enumerate(watchers)] if watched else None
    )
    out = []
    for ids, logp, finish in zip(result.ids, result.logprobs, result.finish):
        text, hit = cut_at_stop(tokenizer.decode(ids), stop)
        kept = ids_through_stop(tokenizer, ids, stop) if hit else ids
        out.append(
            {
                "text": text,
                "ids": kept.tolist(),
                "logprobs": logp[: len(kept)].tolist(),
                "finish_reason": "stop" if hit else finish,
            }
        )
    if stream is not None and encoded:
        rest = watchers[0].rest()
        if rest:
            stream(rest)
    return out


def _follow(watch: StopWatch, stream: Callable[[str], None] | None):
    """The engine's on_tokens for one completion: feeds the watcher, streams what became final,
    stops the completion at a stop string."""

    def on_tokens(new_ids, new_logps=None) -> bool:
        piece = watch.add(new_ids)
        if stream is not None and piece:
            stream(piece)
        return watch.hit

    return on_tokens
