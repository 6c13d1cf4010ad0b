"""The chat template: conversations -> token ids and loss weights, and prompts for generation.

One template for the whole project (SFT, preference training, RL, evaluation and
sampling), so a model is always trained and queried in the same format:

    [BOS] <|system|>\\n{content}<|end|>\\n <|user|>\\n{content}<|end|>\\n <|assistant|>\\n{content}<|end|>\\n ...

With a tokenizer that has the chat roles as control tokens (ours, see
`lm.data.spm.CHAT_TOKENS`) each marker is one id that no text can produce. Other
tokenizers (the byte tokenizer, foreign .model files) get the same strings encoded
as plain text.

Markers, separators and contents are encoded separately and concatenated, so a
token never straddles a marker and a content, and the loss mask is exact: 1 on the
assistant's content and its end marker (the model must learn to stop), 0 elsewhere.
"""

from __future__ import annotations

import sys

import numpy as np

from lm.data.spm import CHAT_TOKENS
from lm.errors import UserError

ROLES = ("system", "user", "assistant")
END = "<|end|>"
TRAIN_ON = ("all", "last")
VERSION = 1  # bump when the rendered ids change for the same messages (cache keys use it)

_MARKERS = dict(zip(ROLES + ("end",), CHAT_TOKENS))
_warned: set[str] = set()  # tokenizers already reported as lacking chat tokens


def check_messages(messages, *, for_training: bool = False, for_prompt: bool = False) -> None:
    """ValueError naming the first bad message; the caller adds where the messages came from."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' is {type(messages).__name__} {_short(messages)}; expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] is {type(m).__name__} {_short(m)}; "
                             "expected an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: role {_short(m.get('role'))} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({m['role']}): content is {type(content).__name__} "
                             f"{_short(content)}; expected a non-empty string")
        if not content:
            raise ValueError(f"messages[{i}] ({m['role']}): content is empty; expected a non-empty string")
    roles = [m["role"] for m in messages]
    if for_training and "assistant" not in roles:
        raise ValueError(f"no assistant turn (roles: {', '.join(roles)}); expected at least one to train on")
    if for_prompt and roles[-1] != "user":
        raise ValueError(f"the last message has role '{roles[-1]}'; expected a user turn to end a prompt")


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ChatTemplate:
    """Renders conversations for one tokenizer. Build it with `for_tokenizer`."""

    def __init__(self, tok, markers: dict[str, np.ndarray], special: bool):
        self.tok, self.special = tok, special
        self.markers = markers  # role or "end" -> ids
        self.newline = _ids(tok.encode("\n"))
        self.bos = np.array([tok.bos_id] if tok.bos_id >= 0 else [], np.int32)

    @classmethod
    def for_tokenizer(cls, tok) -> ChatTemplate:
        ids = _special_ids(tok)
        if ids is not None:
            return cls(tok, {k: np.array([i], np.int32) for k, i in zip(_MARKERS, ids)}, special=True)
        name = getattr(tok, "name", type(tok).__name__)
        if tok.fingerprint() not in _warned:
            _warned.add(tok.fingerprint())
            print(f"chat template: tokenizer {name} has no chat tokens; role markers are plain text",
                  file=sys.stderr, flush=True)
        return cls(tok, {k: _ids(tok.encode(s)) for k, s in _MARKERS.items()}, special=False)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an answer."""
        if self.special:
            return (int(self.markers["end"][0]), int(self.tok.eos_id))
        return (int(self.tok.eos_id),)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends an answer when the end marker is plain text."""
        return () if self.special else (END,)

    def _turn(self, role: str, content: str, weight: float) -> list[tuple[np.ndarray, float]]:
        return [(self.markers[role], 0.0), (self.newline, 0.0), (_ids(self.tok.encode(content)), weight),
                (self.markers["end"], weight), (self.newline, 0.0)]

    def render(self, messages: list[dict], train_on: str = "all") -> tuple[np.ndarray, np.ndarray]:
        """(ids int32[n], weights float32[n]): weight 1 on the trained assistant turns' content and
        end marker ("all": every assistant turn, "last": the last one), 0 elsewhere."""
        if train_on not in TRAIN_ON:
            raise UserError(f"chat template: train_on='{train_on}'; expected one of {', '.join(TRAIN_ON)}")
        check_messages(messages, for_training=True)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        parts = [(self.bos, 0.0)]
        for i, m in enumerate(messages):
            trained = m["role"] == "assistant" and (train_on == "all" or i == last)
            parts += self._turn(m["role"], m["content"], 1.0 if trained else 0.0)
        return _join(parts)

    def prompt(self, messages: list[dict]) -> np.ndarray:
        """The conversation (ending with a user turn) and an open assistant turn: generation
        continues with the answer."""
        check_messages(messages, for_prompt=True)
        parts = [(self.bos, 0.0)]
        for m in messages:
            parts += self._turn(m["role"], m["content"], 0.0)
        parts += [(self.markers["assistant"], 0.0), (self.newline, 0.0)]
        return _join(parts)[0]

    def answer_text(self, ids) -> str:
        """The text of generated ids, up to the first end marker (or EOS)."""
        ids = np.asarray(ids).reshape(-1)
        stops = np.flatnonzero(np.isin(ids, self.stop_ids))
        text = self.tok.decode(ids[: stops[0]] if len(stops) else ids)
        return text if self.special else text.split(END, 1)[0]


def _special_ids(tok) -> list[int] | None:
    """The chat tokens' control ids, or None if the tokenizer lacks any of them."""
    if not hasattr(tok, "special_id"):
        return None
    try:
        return [tok.special_id(t) for t in CHAT_TOKENS]
    except UserError:
        return None


def _ids(x) -> np.ndarray:
    return np.asarray(x, np.int32).reshape(-1)


def _join(parts: list[tuple[np.ndarray, float]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([p for p, _ in parts]).astype(np.int32)
    weights = np.concatenate([np.full(len(p), w, np.float32) for p, w in parts])
    return ids, weights
