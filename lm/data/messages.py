"""Conversations as every chat template takes them: roles, tool calls, what to train on, and validation.

Messages follow OpenAI's chat format: {"role", "content"}, where an assistant turn may also hold
`tool_calls` ([{"type": "function", "id": ..., "function": {"name": ..., "arguments": {...} or a
JSON string}}]) and a `tool` turn holds a tool's result (`tool_call_id` and `name` are passed to the
template as given). An assistant's or a tool's content may be empty (rendered as transformers renders
it: the turn's markers around nothing); a system's or a user's may not.
"""

from __future__ import annotations

import json
from typing import NamedTuple

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("all", "last")


class Example(NamedTuple):
    """A rendered training example: ids, loss weights, how many assistant turns it trains, and
    whether it is a turn trained from its own prefix (the conversation through that turn) because
    the template renders that turn otherwise once the conversation goes on."""

    ids: object  # int32 [n]
    weights: object  # float32 [n]
    turns: int
    own_prefix: bool = False


def check_messages(messages, *, for_training: bool = False, for_prompt: bool = False) -> None:
    """ValueError naming the first bad message; the caller adds where the messages came from."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' is {type(messages).__name__} {_short(messages)}; expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(
                f"messages[{i}] is {type(m).__name__} {_short(m)}; expected an object with 'role' and 'content'"
            )
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: role {_short(m.get('role'))} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({m['role']}): content is {type(content).__name__} "
                f"{_short(content)}; expected a non-empty string"
            )
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}] ({m['role']}): only an assistant turn holds tool_calls")
            tool_calls(m, i)
        if not content and m["role"] in ("system", "user"):
            raise ValueError(f"messages[{i}] ({m['role']}): content is empty; expected a non-empty string")
    roles = [m["role"] for m in messages]
    if for_training and "assistant" not in roles:
        raise ValueError(f"no assistant turn (roles: {', '.join(roles)}); expected at least one to train on")
    if for_prompt and roles[-1] not in ("user", "tool"):
        raise ValueError(
            f"the last message has role '{roles[-1]}'; expected a user turn (or a tool result) to end a prompt"
        )


def tool_calls(message: dict, i: int = 0) -> list[tuple[str, dict]]:
    """(name, arguments) of each call of an assistant turn's `tool_calls` (OpenAI's shape; the
    arguments an object or a JSON string of one). ValueError naming the bad call."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}]: tool_calls is {type(calls).__name__}; expected a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"messages[{i}].tool_calls[{j}]: expected {{'function': {{'name': ..., 'arguments': ...}}}}"
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"messages[{i}].tool_calls[{j}] ({name}): arguments are not JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(
                f"messages[{i}].tool_calls[{j}] ({name}): arguments are {_short(args)}; expected an object"
            )
        out.append((name, args))
    return out


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
