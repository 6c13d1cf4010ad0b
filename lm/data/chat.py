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

Tools (OpenAI's function definitions) are listed in the system turn, one JSON definition a
line; an assistant's calls follow its content as `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>` blocks (the Hermes/Qwen syntax, which lm.infer.serve.tools parses back), and a
tool's result is a `<|tool|>` turn. A tokenizer trained before `<|tool|>` was a control token
writes that one marker as plain text.

Markers, separators and contents are encoded separately and concatenated, so a
token never straddles a marker and a content, and the loss mask is exact: 1 on the
assistant's content (its calls included) and its end marker (the model must learn to stop),
0 elsewhere (tool results included).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from lm.data.messages import TRAIN_ON, Example, check_messages, tool_calls  # noqa: F401 (check_messages: re-exported)
from lm.data.spm import CHAT_TOKENS
from lm.errors import UserError

END = "<|end|>"
VERSION = 1  # bump when the rendered ids change for the same messages (cache keys use it)

_MARKERS = dict(zip(("system", "user", "assistant", "end", "tool"), CHAT_TOKENS))
_REQUIRED = 4  # the tool marker may be missing from a tokenizer (trained before it): plain text then
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
TOOLS_INTRO = "You may call these tools, given one JSON definition per line:"
TOOLS_HOW = (
    'To call one, write <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call> (one block per call); '
    "its result comes back in a tool turn."
)
_warned: set[str] = set()  # tokenizers already reported as lacking chat tokens


class ChatTemplate:
    """Renders conversations for one tokenizer. Build it with `for_tokenizer`."""

    key = VERSION  # names the rendering in cache keys
    # what lm.infer.serve.tools reads a tool-call syntax from (a jinja template's text for HF templates)
    source = "lm chat template: tools in the system turn, calls as <tool_call> JSON </tool_call>, <|tool|> results"

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
            markers = {
                k: np.array([i], np.int32) if i is not None else _ids(tok.encode(t))
                for (k, t), i in zip(_MARKERS.items(), ids)
            }
            return cls(tok, markers, special=True)
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

    def _turns(self, messages: list[dict], trained) -> list[tuple[np.ndarray, float]]:
        parts = [(self.bos, 0.0)]
        for i, m in enumerate(messages):
            parts += self._turn(m["role"], content_text(m, i), 1.0 if trained(i, m) else 0.0)
        return parts

    def render(self, messages: list[dict], train_on: str = "all", tools=None) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32[n], weights float32[n]): weight 1 on the trained assistant turns' content and
        end marker ("all": every assistant turn, "last": the last one), 0 elsewhere."""
        if train_on not in TRAIN_ON:
            raise UserError(f"chat template: train_on='{train_on}'; expected one of {', '.join(TRAIN_ON)}")
        check_messages(messages, for_training=True)
        messages = with_tools(messages, tools)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return _join(self._turns(messages, lambda i, m: m["role"] == "assistant" and (train_on == "all" or i == last)))

    def examples(self, messages: list[dict], train_on: str = "all", since: int = 0) -> list[Example]:
        """The training examples of a conversation, as lm.data.hf_chat.HFChatTemplate.examples: one example,
        as this template renders a turn the same whatever follows it. Turns before messages[since]
        are context (the prompt of a prompt-completion record)."""
        if train_on not in TRAIN_ON:
            raise UserError(f"chat template: train_on='{train_on}'; expected one of {', '.join(TRAIN_ON)}")
        check_messages(messages, for_training=True)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= since]
        trained = set(turns if train_on == "all" else turns[-1:])
        if not trained:
            return []
        return [Example(*_join(self._turns(messages, lambda i, m: i in trained)), len(trained))]

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray:
        """The conversation (ending with a user turn or a tool's result) and an open assistant
        turn: generation continues with the answer. tools: OpenAI's function definitions."""
        check_messages(messages, for_prompt=True)
        parts = self._turns(with_tools(messages, tools), lambda i, m: False)
        parts += [(self.markers["assistant"], 0.0), (self.newline, 0.0)]
        return _join(parts)[0]

    def continuation(self, messages: list[dict], new: list[dict], tools=None) -> np.ndarray:
        """The ids that follow a generated answer ended by a stop id: `messages` is the conversation
        through that answer, `new` the turns after it (tool results, a user's reply); then the
        open assistant turn. A multi-turn episode so keeps the very ids it sampled (it never
        re-encodes its answers)."""
        check_messages(messages + new, for_prompt=True)
        parts = [(self.newline, 0.0)] + self._turns(new, lambda i, m: False)[1:]
        return _join(parts + [(self.markers["assistant"], 0.0), (self.newline, 0.0)])[0]

    def answer_text(self, ids) -> str:
        """The text of generated ids, up to the first end marker (or EOS)."""
        ids = np.asarray(ids).reshape(-1)
        stops = np.flatnonzero(np.isin(ids, self.stop_ids))
        text = self.tok.decode(ids[: stops[0]] if len(stops) else ids)
        return text if self.special else text.split(END, 1)[0]


def prompt_ids(template, conversation, tools: list[dict] | None = None) -> list[int]:
    """The ONE chat-prompt encoder: a conversation (messages ending with a user turn or a tool's
    result, or a string: one user turn) -> the prompt ids with the template's generation prompt.
    tools: OpenAI's function definitions. Bad messages: ValueError."""
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


def _special_ids(tok) -> list[int | None] | None:
    """The chat tokens' control ids, or None if the tokenizer lacks one of the first four (a
    missing tool marker is None: written as plain text)."""
    if not hasattr(tok, "special_id"):
        return None
    ids = []
    for i, t in enumerate(CHAT_TOKENS):
        try:
            ids.append(tok.special_id(t))
        except UserError:
            if i < _REQUIRED:
                return None
            ids.append(None)
    return ids


def with_tools(messages: list[dict], tools) -> list[dict]:
    """The messages with the tools' definitions in the system turn (a new first turn if none)."""
    if not tools:
        return messages
    listed = "\n".join([TOOLS_INTRO] + [json.dumps(t, ensure_ascii=False) for t in tools] + [TOOLS_HOW])
    if messages[0]["role"] == "system":
        return [dict(messages[0], content=messages[0]["content"] + "\n\n" + listed)] + messages[1:]
    return [{"role": "system", "content": listed}] + messages


def content_text(m: dict, i: int = 0) -> str:
    """A message's text as our template writes it: an assistant's calls after its content."""
    calls = [
        CALL_OPEN + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + CALL_CLOSE
        for name, args in tool_calls(m, i)
    ]
    return "\n".join(([m["content"]] if m["content"] else []) + calls)


def _ids(x) -> np.ndarray:
    return np.asarray(x, np.int32).reshape(-1)


def _join(parts: list[tuple[np.ndarray, float]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([p for p, _ in parts]).astype(np.int32)
    weights = np.concatenate([np.full(len(p), w, np.float32) for p, w in parts])
    return ids, weights
