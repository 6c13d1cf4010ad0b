"""Conversations as every chat template takes them: roles, what to train on, and validation."""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("all", "last")


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
