"""A user's Python function named in a config: `module:function` or `path/to/file.py:function`
(RL reward functions, evaluation checkers)."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from typing import Callable

from lm.errors import UserError


def load_function(target: str, label: str = "rl.rewards") -> Callable:
    """`module:function` or `file.py:function` -> the function (`label` names the setting in errors)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"{label}: '{target}'; expected module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = pathlib.Path(where)
            if not path.is_file():
                raise UserError(f"{label}: '{where}' is not a file")
            spec = importlib.util.spec_from_file_location(f"lm_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as e:
        raise UserError(f"{label}: cannot import '{where}' ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{label}: '{where}' has no function '{name}'")
    return fn
