"""OpenAI tools for chat: a request's `tools` and `tool_choice` read and checked, the tool-call
syntax of the model's chat template (FAMILIES: one row per syntax, picked by markers in the
template's text), answers parsed back into OpenAI's `tool_calls`, and the llguidance grammar that
forces a call (tool_choice "required" or a named function).

A call is taken only when it is whole and names a function of the request; an answer with
anything else where a call should be stays `content`, whole. A streamed answer shows its content
as it comes, holds back text from where a call may begin, and ends with the calls in one chunk.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid

from lm.errors import UserError
from lm.infer.grammar import json_lark, lark_grammar
from lm.infer.stops import held_back

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # as OpenAI allows
CHOICES = ("none", "auto", "required")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_TOOL_KEYS, _FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}
_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
_ALNUM = string.ascii_letters + string.digits


class ToolError(UserError):
    """A bad tools field: its one-line message and the request field it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: list  # as given: what the chat template renders
    schemas: dict  # function name -> its parameters' JSON schema
    choice: str  # "none" | "auto" | "required" | "function" (one named function)
    forced: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: "required" may call several


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_tools(body: dict) -> ToolRequest | None:
    """The tools of a chat request body (None: it has none). Bad fields: ToolError naming them."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' is {_short(parallel)}; expected a boolean", "parallel_tool_calls")
    if not tools:
        if tools is not None and tools != []:
            raise ToolError(f"'tools' is {_short(tools)}; expected an array of {_SHAPE}", "tools")
        if choice not in (None, "none"):
            raise ToolError(f"'tool_choice' is {_short(choice)} but the request has no 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError(f"'tools' is {_short(tools)}; expected an array of {_SHAPE}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' has {len(tools)} functions; at most {MAX_TOOLS} are allowed", "tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        name, parameters = _function(tool, i)
        if name in schemas:
            raise ToolError(f"tools[{i}]: function '{name}' is defined twice", "tools")
        schemas[name] = parameters
    kind, forced = _choice(choice, schemas)
    return ToolRequest(list(tools), schemas, kind, forced, parallel is not False)


def _function(tool, i: int) -> tuple[str, dict]:
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
        raise ToolError(f"tools[{i}] is {_short(tool)}; expected {_SHAPE}", "tools")
    fn = tool["function"]
    for where, keys, known in ((f"tools[{i}]", tool, _TOOL_KEYS), (f"tools[{i}].function", fn, _FUNCTION_KEYS)):
        if unknown := sorted(set(keys) - known):
            raise ToolError(f"{where} has unknown field '{unknown[0]}'", "tools")
    name, parameters = fn.get("name"), fn.get("parameters")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"tools[{i}].function.name is {_short(name)}; expected 1 to 64 of a-z A-Z 0-9 _ -", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"tools[{i}].function.description must be a string", "tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(f"tools[{i}].function.parameters is {_short(parameters)}; expected a JSON schema", "tools")
    return name, NO_ARGUMENTS if parameters is None else parameters


def _choice(choice, schemas: dict) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise ToolError(
            f"'tool_choice' is {_short(choice)}; expected 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not isinstance(fn.get("name"), str) or fn["name"] not in schemas:
        known = ", ".join(schemas)
        raise ToolError(
            f"'tool_choice' names function {_short(fn.get('name'))}, not one of 'tools' ({known})", "tool_choice"
        )
    return "function", fn["name"]


def chat_turn(m: dict, role, content, i: int) -> dict:
    """A conversation turn as chat templates take it: an assistant turn's tool_calls with their
    arguments as objects (OpenAI sends JSON text; templates write them with tojson), a tool turn
    with its tool_call_id. Bad calls: ToolError naming messages."""
    turn = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise ToolError(f"messages[{i}].tool_calls must be a non-empty array", "messages")
        turn["tool_calls"] = [_sent_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        turn["content"] = "" if content is None else content
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise ToolError(f"messages[{i}] (tool) needs 'tool_call_id': the id of the call it answers", "messages")
        turn["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            turn["name"] = m["name"]
    return turn


def _sent_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise ToolError(
            f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', "messages"
        )
    arguments = fn.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ToolError(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"{where}.function.arguments must be a JSON object", "messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    return out | ({"id": call["id"]} if isinstance(call.get("id"), str) else {})


# ---- the syntaxes ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """One tool-call syntax: `head`, then calls (`open` JSON `close`) joined by `sep`, then `tail`;
    each JSON is {"name": ..., <args>: {...}}. Whitespace between the pieces is free when parsing."""

    name: str
    markers: tuple[str, ...]  # any of them in a chat template's text: the template uses this syntax
    head: tuple[str, ...]  # pieces before the first call (the grammar allows one space between them)
    open: str
    close: str
    sep: str
    tail: str
    args: str  # the arguments' key the template writes
    anywhere: bool  # calls may follow content (else an answer with calls is calls only)
    parallel: bool = True  # the template renders several calls in one turn
    optional: tuple[str, ...] = ()  # a marker an answer of calls may start with
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates refuse others)
    unless: tuple[str, ...] = ()  # markers of another syntax that shares this one's markers

    @property
    def starts(self) -> tuple[str, ...]:
        """Text that begins the calls of an answer."""
        return (self.head[0] if self.head else self.open.strip() or "{",) + self.optional

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9)) if self.short_ids else "call_" + uuid.uuid4().hex[:24]


# fmt: off
FAMILIES = (
    # Qwen 2.5 / 3, Hermes: one <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> block per call
    Family("hermes", ("<tool_call>",), (), "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments", anywhere=True),
    # Mistral (v3 tokenizers): [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]; not v11's
    # [TOOL_CALLS]name[ARGS]{...}, whose name stands outside the JSON
    Family("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]", "["), "", "", ", ", "]", "arguments", anywhere=True,
           short_ids=True, unless=("[ARGS]",)),
    # Llama 3.1+: {"name": ..., "parameters": {...}} as the whole answer (<|python_tag|> first for built-in tools)
    Family("llama", ("<|python_tag|>", "ipython"), (), "", "", "; ", "", "parameters", anywhere=False,
           parallel=False, optional=("<|python_tag|>",)),
)
# fmt: on
KNOWN = "Llama 3.1+, Qwen 2.5/3 or Hermes, Mistral"


@dataclasses.dataclass(frozen=True)
class ToolSyntax:
    """What a model's chat template does with tools: whether it reads `tools` at all, its call
    syntax (None: none this server reads), and the syntax's markers that are special tokens
    (plain decoding drops those; tool answers keep them)."""

    renders: bool
    family: Family | None = None
    specials: dict = dataclasses.field(default_factory=dict)  # marker text -> token id

    @classmethod
    def of(cls, source: str | None, special_tokens: dict[str, int]) -> ToolSyntax:
        if not source or not re.search(r"\btools\b", source):
            return cls(False)
        known = (f for f in FAMILIES if any(m in source for m in f.markers) and not any(m in source for m in f.unless))
        family = next(known, None)
        marks = () if family is None else family.head + family.optional + (family.open.strip(), family.close.strip())
        return cls(True, family, {m: special_tokens[m] for m in marks if m in special_tokens})

    @property
    def keep(self) -> dict[int, str]:
        return {i: t for t, i in self.specials.items()}


# ---- answers -----------------------------------------------------------------------------------


def _expect(text: str, pos: int, literal: str) -> int | None:
    """The position after `literal` (stripped) at `pos`, whitespace skipped before it; None if absent."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    literal = literal.strip()
    return pos + len(literal) if text.startswith(literal, pos) else None


def _call(text: str, pos: int, names, family: Family) -> tuple[dict, int] | None:
    """One call at `pos`: ({"name", "arguments"}, the position after it), or None."""
    pos = _expect(text, pos, family.open)
    if pos is None or (pos := _expect(text, pos, "{")) is None:
        return None
    try:
        value, pos = json.JSONDecoder().raw_decode(text, pos - 1)
        name = value.get("name") if isinstance(value, dict) else None
        arguments = value.get(family.args, value.get("arguments", value.get("parameters", {}))) if name else None
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return None
    if not isinstance(name, str) or name not in names:
        return None
    if not isinstance(arguments, dict) or (pos := _expect(text, pos, family.close)) is None:
        return None
    return {"name": name, "arguments": arguments}, pos


def parse(family: Family, text: str, names) -> tuple[str, list[dict]] | None:
    """(the content around them, the calls in OpenAI's shape) of an answer, or None when it holds
    no whole call of a function in `names` where its calls begin."""
    if family.anywhere:
        hits = [i for s in family.starts if (i := text.find(s)) >= 0]
        at = min(hits) if hits else None
    else:
        at = len(text) - len(text.lstrip()) if text.lstrip().startswith(family.starts) else None
    if at is None:
        return None
    pos = at
    for marker in family.optional:
        pos = _expect(text, pos, marker) or pos
    for piece in family.head:
        if (pos := _expect(text, pos, piece)) is None:
            return None
    calls = []
    while (found := _call(text, pos, names, family)) is not None:
        calls.append(found[0])
        pos = found[1]
        after = _expect(text, pos, family.sep)
        if after is None or _call(text, after, names, family) is None:
            break
        pos = after
    if not calls or (pos := _expect(text, pos, family.tail)) is None:
        return None
    if not family.anywhere and text[pos:].strip():
        return None
    return text[:at] + text[pos:], [_openai(family, c) for c in calls]


def _openai(family: Family, call: dict) -> dict:
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return {"id": family.new_id(), "type": "function", "function": {"name": call["name"], "arguments": arguments}}


class Answer:
    """One answer as it is generated: `add(text)` returns the content that is final (never text
    where calls may begin), `end()` the rest of the content and the calls (None: there were none)."""

    def __init__(self, family: Family, names):
        self.family, self.names = family, frozenset(names)
        self.text, self.shown, self.calls_at, self.plain = "", 0, None, False

    def add(self, piece: str) -> str:
        self.text += piece
        if self.calls_at is not None:
            return ""
        safe = len(self.text)
        if self.family.anywhere and not self.plain:
            hits = [i for s in self.family.starts if (i := self.text.find(s, self.shown)) >= 0]
            self.calls_at = min(hits) if hits else None
            safe = self.calls_at if hits else safe - held_back(self.text, self.family.starts)
        elif not self.plain:
            body = self.text.lstrip()
            if body.startswith(self.family.starts):
                self.calls_at = 0
                return ""
            if not body or any(s.startswith(body) for s in self.family.starts):
                return ""  # the calls may still begin here
            self.plain = True  # an answer that starts otherwise holds no calls
        out, self.shown = self.text[self.shown : safe], max(self.shown, safe)
        return out

    def end(self) -> tuple[str, list[dict] | None]:
        rest = self.text[self.shown :]
        parsed = parse(self.family, rest, self.names) if self.calls_at is not None else None
        return (rest, None) if parsed is None else parsed

    def whole(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, calls) of a whole answer; content None when it is calls and blank space only."""
        shown = self.add(text)
        rest, calls = self.end()
        content = shown + rest
        return ((content.strip() or None) if calls else content), calls


def finish_reason(finish: str | None, calls) -> str | None:
    return "tool_calls" if calls and finish == "stop" else finish


# ---- a request's plan --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    tools: list  # what the chat template renders
    family: Family | None  # None: answers are not parsed (tool_choice "none")
    names: frozenset
    grammar: str | None = None  # a forced choice: every answer is a call
    keep: dict = dataclasses.field(default_factory=dict)  # special ids whose text stays in answers

    def answer(self) -> Answer | None:
        return None if self.family is None else Answer(self.family, self.names)


def plan(request: ToolRequest, syntax: ToolSyntax | None, schema: dict | None = None) -> ToolPlan:
    """How a request with tools is served by a model whose template has `syntax` (None: a backend
    without chat templates). Refused: ToolError naming the field."""
    if syntax is None or not syntax.renders:
        raise ToolError(
            "the model's chat template defines no tools (it never reads 'tools'); leave 'tools' out", "tools"
        )
    if request.choice == "none":
        return ToolPlan(request.tools, None, frozenset(request.schemas))
    family = syntax.family
    if family is None:
        raise ToolError(
            f"tool_choice {request.choice!r}: the model's chat template renders tools in a call syntax this "
            f"server does not read (it reads {KNOWN}); use tool_choice 'none'",
            "tool_choice",
        )
    grammar = None
    if request.choice in ("required", "function"):
        if schema is not None:
            raise ToolError("'tool_choice' forces a tool call, 'response_format' other output: give one", "tool_choice")
        grammar = forced_grammar(family, request, syntax.specials)
    return ToolPlan(request.tools, family, frozenset(request.schemas), grammar, syntax.keep)


def forced_grammar(family: Family, request: ToolRequest, specials: dict[str, int]) -> str:
    """The llguidance grammar of an answer that is a call of the named function (tool_choice
    "function") or one or more calls of any of them ("required"; one when parallel_tool_calls is
    false or the template renders one call a turn), arguments valid against their schema."""
    names = [request.forced] if request.forced else list(request.schemas)
    many = request.forced is None and request.parallel and family.parallel

    def lit(piece: str) -> str:
        return f"<[{specials[piece]}]>" if piece in specials else json.dumps(piece) if piece else ""

    head = ' " "? '.join(lit(p) for p in family.head)
    rules = [
        "%llguidance {}",
        f"start: {head} call {f'({lit(family.sep)} call)*' if many else ''} {lit(family.tail)}",
        f"call: {lit(family.open)} fn {lit(family.close)}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(names))),
    ]
    for i, name in enumerate(names):
        lead = '{"name": ' + json.dumps(name) + ", " + json.dumps(family.args) + ": "
        rules.append(f'fn_{i}: {json.dumps(lead)} {json_lark(request.schemas[name])} "}}"')
    try:
        return lark_grammar("\n".join(rules))
    except UserError as e:
        raise ToolError(f"'tools' parameters: {e}", "tools") from None
