"""Records of fine-tuning data -> chat messages: the forms users bring (TRL's dataset formats and ours).

Each function takes one record (a JSON value, or a Parquet/Arrow row as a dict) and returns messages,
or raises ValueError naming the key and what was expected (lm.data.records adds FILE:ROW).

  conversation        {"messages": [...]}                                   (SFT)
  prompt-completion   {"prompt": STR | MESSAGES, "completion": STR | MESSAGES} (SFT; TRL's prompt-completion
                      and conversational prompt-completion: only the completion is trained)
  instruction         {"instruction", "input"?, "output", "system"?}        (SFT)
  pair                {"prompt", "chosen", "rejected"}, or TRL's implicit prompt: "chosen" and "rejected"
                      whole conversations, the prompt being the messages they both start with

A string prompt is one user turn and a string response one assistant turn.
"""

from __future__ import annotations

from lm.data.messages import check_messages


class Identical(ValueError):
    """Chosen and rejected are the same response."""


SFT_FORMS = "'messages' (chat), 'prompt' and 'completion', or 'instruction' and 'output' (instruction)"


def sft_example(record) -> tuple[list[dict], int]:
    """(messages, since): the conversation of an SFT record and the index of its first trained
    message (0, or where a prompt-completion record's completion starts)."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}; expected an object with {SFT_FORMS}")
    if "messages" in record:
        return record["messages"], 0
    if "prompt" in record or "completion" in record:
        return _prompt_completion(record)
    if "instruction" in record or "output" in record:
        return _instruction_messages(record), 0
    raise ValueError(f"keys {sorted(record)}; expected {SFT_FORMS}")


def sft_messages(record) -> list[dict]:
    """The whole conversation of an SFT record (any form)."""
    return sft_example(record)[0]


def _prompt_completion(record: dict) -> tuple[list[dict], int]:
    for key in ("prompt", "completion"):
        if key not in record:
            raise ValueError(
                f"no '{key}' (keys: {', '.join(sorted(record))}); a prompt-completion record needs "
                "'prompt' and 'completion'"
            )
    prompt = _turns(record, "prompt", "user")
    completion = _turns(record, "completion", "assistant")
    try:
        check_messages(prompt)
    except ValueError as e:
        raise ValueError(f"'prompt': {e}") from None
    try:
        check_messages(completion, for_training=True)
    except ValueError as e:
        raise ValueError(f"'completion': {e}") from None
    return prompt + completion, len(prompt)


def _turns(record: dict, key: str, role: str) -> list[dict]:
    value = record[key]
    if isinstance(value, str):
        if not value:
            raise ValueError(f"'{key}' is empty; expected a non-empty string or a list of messages")
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ValueError(f"'{key}' is {type(value).__name__}; expected a string or a list of chat messages")


def _instruction_messages(record: dict) -> list[dict]:
    for key, required in (("instruction", True), ("output", True), ("input", False), ("system", False)):
        if key not in record:
            if required:
                raise ValueError(f"no '{key}'; an instruction record needs 'instruction' and 'output' strings")
        elif not isinstance(record[key], str):
            raise ValueError(f"'{key}' is {type(record[key]).__name__}; expected a string")
    for key in ("instruction", "output"):
        if not record[key]:
            raise ValueError(f"'{key}' is empty; expected a non-empty string")
    user = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []  # "" = none
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def prompt_messages(prompt, key: str = "prompt") -> list[dict]:
    """A prompt as chat messages ending with a user turn; ValueError if it is not one."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"'{key}' is empty; expected a non-empty string or a list of messages")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        check_messages(prompt, for_prompt=True)
        return prompt
    raise ValueError(f"'{key}' is {type(prompt).__name__}; expected a string or a list of chat messages")


def response_message(record: dict, key: str) -> dict:
    """A response as one assistant message: a string, or TRL's [{"role": "assistant", "content": ...}]."""
    value = record[key]
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], dict)
        and value[0].get("role") == "assistant"
    ):
        value = value[0].get("content")
    if not isinstance(value, str):
        raise ValueError(
            f'\'{key}\' is {type(value).__name__}; expected a string or [{{"role": "assistant", "content": ...}}]'
        )
    if not value:
        raise ValueError(f"'{key}' is empty; expected a non-empty response")
    return {"role": "assistant", "content": value}


def pair_messages(record) -> tuple[list[dict], dict, dict]:
    """(prompt messages, chosen message, rejected message) of a preference record, its prompt
    explicit or implicit."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}; expected an object with 'prompt', 'chosen', 'rejected'")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ValueError(
                f"no '{key}' (keys: {', '.join(sorted(record))}); a pair needs 'prompt', 'chosen' and 'rejected'"
            )
    if "prompt" not in record:
        return _implicit_prompt(record)
    prompt = prompt_messages(record["prompt"])
    return prompt, response_message(record, "chosen"), response_message(record, "rejected")


def _implicit_prompt(record: dict) -> tuple[list[dict], dict, dict]:
    """TRL's implicit prompt: the messages both conversations start with; each goes on with one
    assistant message."""
    for key in ("chosen", "rejected"):
        if not isinstance(record[key], list):
            raise ValueError(
                f"no 'prompt', and '{key}' is {type(record[key]).__name__}; a pair needs 'prompt', or 'chosen' "
                "and 'rejected' as conversations that start with the same messages (an implicit prompt)"
            )
        try:
            check_messages(record[key])
        except ValueError as e:
            raise ValueError(f"'{key}': {e}") from None
    chosen, rejected = record["chosen"], record["rejected"]
    if chosen == rejected:
        raise Identical("'chosen' and 'rejected' are identical; a pair needs two different responses")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError(
            "no 'prompt', and 'chosen' and 'rejected' differ from their first message; an implicit prompt "
            "is the messages both start with"
        )
    try:
        prompt = prompt_messages(chosen[:shared])
    except ValueError as e:
        raise ValueError(f"the implicit prompt (the {shared} messages 'chosen' and 'rejected' share): {e}") from None
    responses = []
    for key, rest in (("chosen", chosen[shared:]), ("rejected", rejected[shared:])):
        if len(rest) != 1:
            roles = ", ".join(str(m.get("role")) for m in rest) or "none"
            raise ValueError(
                f"'{key}' goes on after the implicit prompt with {len(rest)} messages (roles: {roles}); "
                "expected one assistant message"
            )
        responses.append(response_message({key: rest}, key))
    return prompt, responses[0], responses[1]
