"""A model's own jinja chat template behind the interface of `lm.data.chat.ChatTemplate`.

Rendering follows transformers' `apply_chat_template`: a sandboxed jinja environment with
trim_blocks and lstrip_blocks, its `tojson`, `raise_exception` and `strftime_now`, the named
special tokens as variables, and the whole rendered text tokenized once without added special
tokens, so the ids are HF's.

Loss weights come from character spans: the assistant turn i spans from the end of the text of
messages[:i] with the generation prompt (where generation starts) to the end of the first
end-of-turn token after its content (the model must learn to stop). Every token whose character
offsets overlap a span is weighted, so a token that a BPE merge makes straddle a turn boundary
counts once. Templates whose prefixes do not render as prefixes (e.g. ones that drop earlier
reasoning) use their `{% generation %}` blocks instead, or fail.

Training examples (`examples`) follow what the model sees when it writes each turn: a turn is
trained inside the whole conversation when the conversation renders it as it renders from its own
prefix (the conversation through that turn, the turn last); a turn the template renders otherwise
once the conversation goes on (Qwen3's drops an earlier turn's <think> reasoning) is trained as an
example of its own: the conversation through that turn, weighted on that turn only.
"""

from __future__ import annotations

import functools
import hashlib
import json
from contextvars import ContextVar
from datetime import datetime

import numpy as np

from lm.data.messages import TRAIN_ON, Example, check_messages
from lm.errors import UserError

VERSION = 2  # bump when the rendered ids or weights change for the same template and messages
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")  # common names, when the probe says nothing
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
_TRACKED: ContextVar = ContextVar("generation_spans", default=None)  # (blocks so far, spans) of a render


class _NotPrefix(Exception):
    pass


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: records where the block's text lands in the output."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if (tracked := _TRACKED.get()) is not None:
                blocks, spans = tracked
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set '{name}' on a namespace")
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        namespace=Namespace,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=lambda *a, **k: dict(*a, **k),
    )
    return env.from_string(source)


class HFChatTemplate:
    """Renders conversations with an HF tokenizer's own template. Build it with
    `lm.data.chat.ChatTemplate.for_tokenizer`, the one place a template is chosen."""

    special = True  # the template's markers are the tokenizer's special tokens
    stop_strings: tuple[str, ...] = ()  # answers end at stop ids

    def __init__(self, tok, source: str):
        self.tok, self._source = tok, source
        self.source = source  # the jinja text (what lm serve reads a tool-call syntax from)
        file = tok.chat_template_file() if hasattr(tok, "chat_template_file") else None
        self._origin = str(file) if file is not None else f"chat template of {tok.name}"
        try:
            self._template = _compile(source)
        except Exception as e:  # a syntax error names its line
            raise UserError(f"chat template '{self._origin}': {_line(e)}") from e
        self._variables = tok.template_variables() if hasattr(tok, "template_variables") else {}
        self._specials = tok.special_tokens()  # text -> id
        self.stop_ids = tuple(dict.fromkeys(tuple(tok.stop_ids) + self._end_of_turn_ids()))
        names = {i: t for t, i in self._specials.items()}
        self._stop_texts = tuple(names[i] for i in self.stop_ids if i in names)
        self.key = f"hf{VERSION}-" + hashlib.sha256(source.encode()).hexdigest()[:16]  # for cache keys

    def _text(self, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> str:
        """The rendered text, as transformers' apply_chat_template(tokenize=False) gives it."""
        return self._render(messages, add_generation_prompt, tools)[0]

    def _render(self, messages, add_generation_prompt: bool, tools=None) -> tuple[str, list[tuple[int, int]]]:
        blocks, spans = [], []
        context = dict(
            self._variables,
            messages=[dict(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
        token = _TRACKED.set((blocks, spans))
        try:
            for block in self._template.generate(**context):
                blocks.append(block)
        except Exception as e:  # raise_exception, or the template failing on these messages
            raise UserError(f"chat template '{self._origin}': {_line(e)}") from None
        finally:
            _TRACKED.reset(token)
        return "".join(blocks), spans

    def render(self, messages: list[dict], train_on: str = "all") -> tuple[np.ndarray, np.ndarray]:
        """(ids int32[n], weights float32[n]): weight 1 on the trained assistant turns' text and
        end-of-turn token ("all": every assistant turn, "last": the last one), 0 elsewhere."""
        trained, full, generated = self._start(messages, train_on)
        try:
            spans = [self._turn_span(messages, i, full) for i in trained]
        except _NotPrefix as e:
            if not generated:
                raise self._not_found(e) from None
            spans = generated if train_on == "all" else generated[-1:]
        return self._weighted(full, spans)

    def examples(self, messages: list[dict], train_on: str = "all", since: int = 0) -> list[Example]:
        """The training examples of a conversation (lm.data.messages.Example): the whole conversation
        with weight on the trained assistant turns it renders as they render from their own prefix,
        then one example per trained turn it renders otherwise (the conversation through that turn,
        only it weighted). Examples that would train no turn are left out. train_on as `render`;
        turns before messages[since] are context (the prompt of a prompt-completion record)."""
        trained, full, generated = self._start(messages, train_on, since)
        in_place, own = [], []
        for i in trained:
            try:
                text, span = self._own_span(messages, i)
            except _NotPrefix as e:
                if not generated:
                    raise self._not_found(e) from None
                turns = self._assistant_turns(messages)
                if len(generated) == len(turns):  # a block per turn: the trained ones
                    blocks = [span for span, t in zip(generated, turns) if t in trained]
                else:
                    blocks = generated if train_on == "all" else generated[-1:]
                return [Example(*self._weighted(full, blocks), len(trained))]
            if full[: span[1]] == text[: span[1]]:
                in_place.append(span)
            else:
                own.append((text, span))
        out = [Example(*self._weighted(full, in_place), len(in_place))] if in_place else []
        return out + [Example(*self._weighted(text, [span]), 1, True) for text, span in own]

    def _start(self, messages, train_on: str, since: int = 0) -> tuple[list[int], str, list]:
        if train_on not in TRAIN_ON:
            raise UserError(f"chat template: train_on='{train_on}'; expected one of {', '.join(TRAIN_ON)}")
        check_messages(messages, for_training=True)
        full, generated = self._render(messages, False)
        turns = [i for i in self._assistant_turns(messages) if i >= since]
        return (turns if train_on == "all" else turns[-1:]), full, generated

    @staticmethod
    def _assistant_turns(messages) -> list[int]:
        return [i for i, m in enumerate(messages) if m["role"] == "assistant"]

    def _not_found(self, e: Exception) -> UserError:
        return UserError(
            f"chat template '{self._origin}': cannot find the assistant's text: {e}, and the "
            "template has no {% generation %} blocks to mark it"
        )

    def _weighted(self, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `text`, weighted 1 where a token's characters overlap a span."""
        ids, offsets = self.tok.encode_offsets(text)
        weights = np.zeros(len(ids), np.float32)
        for j, (start, end) in enumerate(offsets):
            if any(start < b and end > a for a, b in spans):
                weights[j] = 1.0
        return np.asarray(ids, np.int32), weights

    def _own_span(self, messages, i: int) -> tuple[str, tuple[int, int]]:
        """messages[:i + 1] rendered (turn i last, as when the model writes it) and turn i's span
        in it: from the end of its generation prompt to the end of the first end-of-turn token
        after its content."""
        try:
            prompt = self._text(messages[:i], add_generation_prompt=True)
            text = self._text(messages[: i + 1])
        except UserError as e:
            raise _NotPrefix(f"rendering the conversation up to messages[{i}] failed ({e})") from None
        if not text.startswith(prompt):
            raise _NotPrefix(
                f"messages[:{i}] with the generation prompt do not render as a prefix of messages[:{i + 1}]"
            )
        content = messages[i]["content"].strip() or messages[i]["content"]
        at = text.find(content, len(prompt))
        end = self._first_end(text, at + len(content) if at >= 0 else len(prompt), len(text))
        return text, (len(prompt), end[1] if end is not None else len(text))

    def _turn_span(self, messages, i: int, full: str) -> tuple[int, int]:
        """Where assistant turn i's text lies in `full`: from the end of its generation prompt to
        the end of the first end-of-turn token after its content. The prompt must render as a prefix
        (generation starts there); a turn that renders otherwise as the last message (a template
        that shows reasoning only then) is found by its content, before the next end of turn."""
        try:
            prompt = self._text(messages[:i], add_generation_prompt=True)
            turn = self._text(messages[: i + 1])
        except UserError as e:
            raise _NotPrefix(f"rendering the conversation up to messages[{i}] failed ({e})") from None
        if not full.startswith(prompt):
            raise _NotPrefix(f"messages[:{i}] with the generation prompt do not render as a prefix of the conversation")
        consistent = full.startswith(turn) and len(turn) >= len(prompt)
        limit = len(turn) if consistent else len(full)
        content = messages[i]["content"].strip() or messages[i]["content"]
        at = full.find(content, len(prompt), limit)
        first_end = self._first_end(full, len(prompt), limit)
        if not consistent and (at < 0 or (first_end is not None and at >= first_end[0])):
            raise _NotPrefix(
                f"messages[:{i + 1}] do not render as a prefix of the conversation, and messages[{i}]'s "
                "content is not where the template continues after its prompt"
            )
        end = self._first_end(full, at + len(content) if at >= 0 else len(prompt), limit)
        if end is None and not consistent:
            raise _NotPrefix(
                f"messages[:{i + 1}] do not render as a prefix of the conversation, and no end of turn "
                f"follows messages[{i}]'s content"
            )
        return len(prompt), (end[1] if end is not None else limit)

    def _first_end(self, text: str, start: int, stop: int) -> tuple[int, int] | None:
        """(start, end) of the first end-of-turn token in text[start:stop] (the longest one at a tie)."""
        found = [(p, -len(t)) for t in self._stop_texts if (p := text.find(t, start, stop)) >= 0]
        return (min(found)[0], min(found)[0] - min(found)[1]) if found else None

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> np.ndarray:
        """The conversation (ending with a user turn, or with tools a tool turn) and the template's
        generation prompt. tools: OpenAI's function definitions, passed as transformers'
        apply_chat_template(tools=...) passes them; turns may then hold tool calls and results."""
        check_messages(messages, for_prompt=True)
        return np.asarray(self.tok.encode(self._text(messages, True, tools)), np.int32)

    def continuation(self, messages: list[dict], new: list[dict], tools=None) -> np.ndarray:
        """As `ChatTemplate.continuation`: the text the template writes after the answer's
        end-of-turn token (which the answer's ids end with) up to the generation prompt, encoded.
        A template whose earlier turns render otherwise once followed (one that drops earlier
        reasoning) cannot continue an episode: UserError."""
        check_messages(messages + new, for_prompt=True)
        before, after = self._text(messages, False, tools), self._text(messages + new, True, tools)
        end = max((before.rfind(t) + len(t) for t in self._stop_texts if t in before), default=-1)
        if end < 0 or not after.startswith(before[:end]):
            raise UserError(
                f"chat template '{self._origin}': a conversation followed by more turns does not render as "
                "its continuation (the template rewrites earlier turns); it cannot run multi-turn episodes"
            )
        return np.asarray(self.tok.encode(after[end:]), np.int32)

    def answer_text(self, ids) -> str:
        """The text of generated ids, up to the first stop id."""
        ids = np.asarray(ids).reshape(-1)
        stops = np.flatnonzero(np.isin(ids, self.stop_ids))
        return self.tok.decode(ids[: stops[0]] if len(stops) else ids)

    def _end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token the template writes right after an assistant's content (<|im_end|>,
        <|eot_id|>, <end_of_turn>, ...), found by rendering a probe; else the common names it contains."""
        try:
            prompt, turn = self._text(_PROBE[:1], True), self._text(_PROBE)
        except UserError:
            prompt = turn = ""
        if turn.startswith(prompt) and (at := turn.find("Hello", len(prompt))) >= 0:
            tail = turn[at + len("Hello") :]
            found = [(tail.find(t), -len(t), i) for t, i in self._specials.items() if t in tail]
            if found:
                return (min(found)[2],)
        return tuple(self._specials[t] for t in END_OF_TURN if t in self._specials and t in self._source)


def _line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    return (text[0] if text else type(e).__name__) + where
