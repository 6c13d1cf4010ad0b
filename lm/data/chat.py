"""The chat template: conversations -> token ids and loss weights, and prompts for generation.

One template per model, chosen in one place (`ChatTemplate.for_tokenizer`) and used by SFT,
preference training, RL, evaluation and sampling alike, so a model is always trained and
queried in the same format. An imported checkpoint whose tokenizer carries its own jinja
template gets that one (`lm.data.hf_chat`); every other model gets ours:

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

from lm.data.messages import ROLES, TRAIN_ON, check_messages  # noqa: F401 (check_messages: re-exported)
from lm.data.spm import CHAT_TOKENS
from lm.errors import UserError

END = "<|end|>"
VERSION = 1  # bump when the rendered ids change for the same messages (cache keys use it)

_MARKERS = dict(zip(ROLES + ("end",), CHAT_TOKENS))
_warned: set[str] = set()  # tokenizers already reported as lacking chat tokens


class ChatTemplate:
    """Renders conversations for one tokenizer. Build it with `for_tokenizer`."""

    key = VERSION  # names the rendering in cache keys

    def __init__(self, tok, markers: dict[str, np.ndarray], special: bool):
        self.tok, self.special = tok, special
        self.markers = markers  # role or "end" -> ids
        self.newline = _ids(tok.encode("\n"))
        self.bos = np.array([tok.bos_id] if tok.bos_id >= 0 else [], np.int32)

    @classmethod
    def for_tokenizer(cls, tok) -> ChatTemplate:
        """The ONE place a template is chosen: a tokenizer's own chat template (an imported HF
        checkpoint's, lm.data.hf_chat.HFChatTemplate, same interface) when it has one, else ours."""
        source = tok.chat_template() if hasattr(tok, "chat_template") else None
        if source:
            from lm.data.hf_chat import HFChatTemplate  # lazy: needs jinja2

            return HFChatTemplate(tok, source)
        ids = _special_ids(tok)
        if ids is not None:
            return cls(tok, {k: np.array([i], np.int32) for k, i in zip(_MARKERS, ids)}, special=True)
        name = getattr(tok, "name", type(tok).__name__)
        if tok.fingerprint() not in _warned:
            _warned.add(tok.fingerprint())
            print(
                f"chat template: tokenizer {name} has no chat tokens; role markers are plain text",
                file=sys.stderr,
                flush=True,
            )
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
        return [
            (self.markers[role], 0.0),
            (self.newline, 0.0),
            (_ids(self.tok.encode(content)), weight),
            (self.markers["end"], weight),
            (self.newline, 0.0),
        ]

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


def prompt_ids(template, conversation, tools: list[dict] | None = None) -> list[int]:
    """The ONE chat-prompt encoder: a conversation (messages ending with a user turn, or a string:
    one user turn) -> the prompt ids with the template's generation prompt. Bad messages: ValueError.
    tools (OpenAI's function definitions): only a model's own template (HFChatTemplate) renders them."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    return [int(t) for t in (template.prompt(messages) if tools is None else template.prompt(messages, tools))]


def chat_prompts(tokenizer, conversations: list) -> tuple[list[list[int]], ChatTemplate]:
    """Prompt ids of each conversation (see `prompt_ids`) with `tokenizer`'s chat template, and the
    template (its stop ids and strings end the answers). Bad messages: UserError naming the one."""
    template = ChatTemplate.for_tokenizer(tokenizer)
    out = []
    for i, conversation in enumerate(conversations):
        try:
            out.append(prompt_ids(template, conversation))
        except ValueError as e:
            raise UserError(f"conversation {i}: {e}") from None
    return out, template


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
