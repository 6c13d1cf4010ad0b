"""The OpenAI request and response shapes: a request body read into `Request` (or a `RequestError`
naming the field), and the JSON of completions, chunks, usage and errors.

Fields OpenAI does not define are refused (400 naming them), as OpenAI's own API does, and so
are OpenAI fields this server does not implement when they ask for something (logprobs,
penalties, ...); at their neutral value (null, 0, false) they are accepted. Tools and tool turns
are read by lm.infer.serve.tools. A body nested deeper than MAX_DEPTH is refused before it is
parsed (the size limit, MAX_BODY, is the Guard's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

import numpy as np

from lm.errors import UserError
from lm.infer.grammar import schema_of
from lm.infer.serve.tools import ToolError, ToolRequest, chat_turn, read_tools

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_BODY = 8 * 2**20  # bytes in a request body: the longest context's prompt, JSON-escaped, fits many times over
MAX_WAITING = 256  # requests waiting for a slot beyond which new ones get 429
# arrays and objects inside each other: json.loads recurses once per level (a RecursionError near
# 1,000), and no request this server takes needs more than 5
MAX_DEPTH = 64
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_CHUNK = 1 << 20

_SAMPLING = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "user",
    "top_k",
    "min_p",
)
KNOWN = {
    "completion": frozenset(_SAMPLING + ("prompt", "response_format")),  # response_format: an extension here
    "chat": frozenset(
        _SAMPLING
        + ("messages", "max_completion_tokens", "response_format", "tools", "tool_choice", "parallel_tool_calls")
    ),
}
# OpenAI fields not implemented: accepted only at a value that asks for nothing
NEUTRAL = {
    "completion": {
        "echo": (False,),
        "logprobs": (0,),
        "best_of": (1,),
        "presence_penalty": (0,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
        "suffix": ("",),
    },
    "chat": {
        "logprobs": (False,),
        "top_logprobs": (0,),
        "presence_penalty": (0,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
        "store": (False,),
        "metadata": ({},),
    },
}


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.param, self.code, self.kind)


def error_body(
    message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class Request:
    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None  # None: as many as fit (chat) or 16 (completion, OpenAI's default)
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    schema: dict | None = None  # the JSON schema the answer must follow (response_format; None: free text)
    tools: ToolRequest | None = None  # chat: the functions the model may call, and tool_choice


def _type_name(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _get(body: dict, name: str, expected: str, ok, default):
    """body[name] if `ok` accepts it; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise RequestError(f"'{name}' is {_type_name(value)} ({json.dumps(value)[:40]}); expected {expected}", name)
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_range(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise RequestError(f"'{name}' is {value}; expected {expected}", name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' has {len(stop)} strings; at most {MAX_STOP} are allowed", "stop")
    return tuple(stop)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise RequestError("missing required field 'prompt'", "prompt")
    if not isinstance(prompt, str):
        raise RequestError(
            "'prompt' must be a string or an array of one string (token arrays and batches of "
            "prompts are not supported)",
            "prompt",
        )
    if not prompt:
        raise RequestError("'prompt' is empty; give at least one character of text", "prompt")
    return prompt


def _content(value, i: int):
    """A message's content: a string, or OpenAI's array of text parts (joined)."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise RequestError(
                f'messages[{i}].content: only text parts ({{"type": "text", "text": ...}}) are supported', "messages"
            )
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError('\'messages\' must be a non-empty array of {"role", "content"} objects', "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(
                f"messages[{i}] is {_type_name(m)}; expected an object with 'role' and 'content'", "messages"
            )
        role = "system" if m.get("role") == "developer" else m.get("role")  # OpenAI's newer name for system
        out.append(chat_turn(m, role, _content(m.get("content"), i), i))
    return out


def _check_fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in KNOWN[kind]:
            continue
        if name not in NEUTRAL[kind]:
            raise RequestError(f"unrecognized request field '{name}'", name, code="unknown_field")
        if value is not None and value not in NEUTRAL[kind][name]:
            raise RequestError(
                f"'{name}' is not supported by this server (leave it out)", name, code="unsupported_field"
            )


def nesting(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, brackets inside strings left out: a scan
    of the bytes (in chunks: bounded memory), so that a body too deep to parse is refused unparsed."""
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)  # now '"' starts or ends a string
    depth = deepest = quotes = 0
    for i in range(0, text.size, _CHUNK):
        part = text[i : i + _CHUNK]
        seen = quotes + np.cumsum(part == ord('"'))
        step = np.isin(part, _OPEN).astype(np.int64) - np.isin(part, _CLOSE)
        running = depth + np.cumsum(np.where(seen % 2 == 0, step, 0))
        deepest, depth, quotes = max(deepest, int(running.max())), int(running[-1]), int(seen[-1])
    return deepest


def check_content_type(value: str | None) -> None:
    """JSON or nothing said. Refusing other types also keeps browsers' cross-site "simple" posts
    (forms, text/plain), which need no preflight, away from a server on localhost."""
    media = (value or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise RequestError(
            f"Content-Type '{value}': expected application/json (curl: -H 'Content-Type: application/json')",
            status=415,
            code="unsupported_media_type",
        )


def _load(raw: bytes):
    depth = nesting(raw)
    if depth > MAX_DEPTH:
        raise RequestError(
            f"the request body nests arrays and objects {depth} levels deep; at most {MAX_DEPTH} are allowed",
            code="too_deeply_nested",
        )
    try:
        return json.loads(raw)
    except RecursionError:  # a deep body that the scan misread (it is not JSON then)
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels", code="too_deeply_nested") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: also an integer of over 4,300 digits
        raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from None


def parse_request(raw: bytes, kind: str) -> Request:
    """The request of a /v1/completions ("completion") or /v1/chat/completions ("chat") body."""
    body = _load(raw)
    if not isinstance(body, dict):
        raise RequestError(f"the request body is {_type_name(body)}; expected a JSON object")
    _check_fields(body, kind)
    model = _get(body, "model", "a string", lambda v: isinstance(v, str), None)
    if model is None:
        raise RequestError("missing required field 'model'", "model")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    max_tokens = _get(body, "max_tokens", "an integer", _is_int, 16 if kind == "completion" else None)
    if max_tokens is not None:
        _check_range("max_tokens", max_tokens, max_tokens >= 1, "at least 1")
    temperature = _get(body, "temperature", "a number", _is_number, 1.0)
    _check_range("temperature", temperature, 0 <= temperature <= 2, "0 to 2 (0 = greedy)")
    top_p = _get(body, "top_p", "a number", _is_number, 1.0)
    _check_range("top_p", top_p, 0 < top_p <= 1, "in (0, 1] (1 = off)")
    top_k = _get(body, "top_k", "an integer", _is_int, 0)
    _check_range("top_k", top_k, 0 <= top_k < 2**31, "0 to 2147483647 (0 = off)")  # the engine keeps int32
    min_p = _get(body, "min_p", "a number", _is_number, 0.0)
    _check_range("min_p", min_p, 0 <= min_p < 1, "in [0, 1) (0 = off)")
    n = _get(body, "n", "an integer", _is_int, 1)
    _check_range("n", n, n == 1, "1 (one completion per request)")
    seed = _get(body, "seed", "an integer", _is_int, None)
    stream = _get(body, "stream", "a boolean", lambda v: isinstance(v, bool), False)
    options = _get(body, "stream_options", "an object", lambda v: isinstance(v, dict), {})
    include_usage = _get(options, "include_usage", "a boolean", lambda v: isinstance(v, bool), False)
    _get(body, "user", "a string", lambda v: isinstance(v, str), None)
    response_format = _get(body, "response_format", "an object", lambda v: isinstance(v, dict), None)
    try:
        schema = schema_of(response_format) if response_format is not None else None
    except UserError as e:
        raise RequestError(str(e), "response_format") from None
    try:
        messages, tools = (_messages(body), read_tools(body)) if kind == "chat" else (None, None)
    except ToolError as e:
        raise RequestError(str(e), e.param) from None
    return Request(
        kind,
        model,
        _prompt(body) if kind == "completion" else None,
        messages,
        max_tokens,
        float(temperature),
        float(top_p),
        top_k,
        float(min_p),
        seed,
        _stop(body),
        stream,
        include_usage,
        schema,
        tools,
    )


# ---- responses ---------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(kind: str, rid: str, created: int, model: str, chunk: bool) -> dict:
    names = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
    return {"id": rid, "object": names[kind], "created": created, "model": model}


def completion_body(
    kind: str, rid: str, created: int, model: str, text: str | None, finish: str, used: dict, tool_calls=None
) -> dict:
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    else:
        message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    return _envelope(kind, rid, created, model, False) | {"choices": [choice], "usage": used}


def chunk_body(
    kind: str,
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish: str | None,
    include_usage: bool,
    role: bool = False,
    tool_calls: list | None = None,
) -> dict:
    """A streamed piece: new text, or "" with the finish reason. text=None: the closing usage chunk
    (no choices; the caller adds the usage). role: chat's opening chunk. tool_calls: a chat
    answer's calls, whole, each with its index."""
    body = _envelope(kind, rid, created, model, True)
    if text is None:
        return body | {"choices": []}
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    else:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        if tool_calls:
            delta = {"tool_calls": [{"index": i} | call for i, call in enumerate(tool_calls)]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return body | {"choices": [choice]} | ({"usage": None} if include_usage else {})


def now() -> int:
    return int(time.time())
