"""A task file: JSONL objects, one example per line, with FILE:LINE errors (lm.data.jsonl)."""

from __future__ import annotations

import itertools
import pathlib

from lm.data.jsonl import ONE_OBJECT, iter_jsonl
from lm.errors import UserError


def read_task_file(path, limit: int = 0) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line; FILE:LINE errors for anything else."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"task file '{path}' does not exist")
    out = list(itertools.islice(iter_jsonl(path, _object, expected=ONE_OBJECT), limit or None))
    if not out:
        raise UserError(f"task file '{path}' holds no examples")
    return out


def _object(value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}; expected an object")
    return value
