"""Stop strings: the one watcher that follows a completion's new tokens, says when its text holds a
stop string, and hands out the text that is final. `lm sample` (lm.infer.text) and `lm serve`
(lm.infer.serve.engine_backend) both stream through it, so both hold back the same text.

Final text is never a stop string or the start of one, never half a character: a piece that may
turn out to begin a stop string is held back until the next tokens show it does not (then it is
released) or it does (then it is cut, with everything after it).
"""

from __future__ import annotations

import numpy as np


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may be the start of a stop string (not shown yet:
    the next piece may complete the stop string, and its text is never part of a completion)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """(text before the first stop string, whether one was found)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def ids_through_stop(tokenizer, ids: np.ndarray, stop: tuple[str, ...]) -> np.ndarray:
    """The fewest leading ids whose text holds the first stop string (all of them when none does)."""
    hits = [i for i in (tokenizer.decode(ids).find(s) for s in stop) if i >= 0]
    if not hits:
        return ids
    cut = min(hits)
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if len(text) > cut and any(s in text for s in stop):
            return ids[:k]
    return ids


class StopWatch:
    """Follows one completion: `add(new_ids)` returns the text that became final, `hit` says a stop
    string has appeared, `rest()` returns what is left to show once the completion has ended."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.shown, self.hit = 0, False

    def text(self) -> str:
        """The text so far, cut before the first stop string (and `hit` updated)."""
        text, self.hit = cut_at_stop(self.tokenizer.decode(np.asarray(self.ids, np.int32)), self.stop)
        return text

    def add(self, new_ids) -> str:
        """Takes new ids; returns the text that became final with them (may be "")."""
        self.ids += [int(t) for t in new_ids]
        text = self.text()
        final = text if self.hit else text.rstrip("\ufffd")  # a character whose bytes are not all there yet
        safe = len(final) - (0 if self.hit else held_back(final, self.stop))
        if safe <= self.shown:
            return ""
        piece, self.shown = final[self.shown : safe], safe
        return piece

    def rest(self) -> str:
        """The text not shown yet, once the completion has ended (what was held back is final now)."""
        text = self.text()
        piece, self.shown = text[self.shown :], max(self.shown, len(text))
        return piece
