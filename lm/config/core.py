"""The config machinery: checked merging, dotted overrides, loading a config file, and `require`.

A config is a ConfigDict of sections; the schema (`lm.config.schema.base_config`) holds every key
with its default, and the default's type is the key's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import pathlib

import ml_collections

from lm.config.moved import moved_message
from lm.errors import UserError

ConfigDict = ml_collections.ConfigDict

ON_BAD_RECORD = ("error", "skip")  # a bad input record: "error" stops naming file and line; "skip" counts it


def require(ok: bool, key: str, value, expected: str) -> None:
    """The one check: raises a UserError naming the dotted key, its value and what was expected."""
    if not ok:
        raise UserError(f"config key '{key}' = {value!r}: {expected}")


def check_choices(name: str, section, choices: dict) -> None:
    for key, options in choices.items():
        require(section[key] in options, f"{name}.{key}", section[key], f"expected one of {options}")


def from_section(cls, section, **given):
    """A frozen dataclass with every field read from the config section (`given` ones excepted)."""
    return cls(**given, **{f.name: section[f.name] for f in dataclasses.fields(cls) if f.name not in given})


def _unknown(dotted: str, key: str, options, value=None) -> UserError:
    """The error for a key the schema lacks: where it moved, else the closest known key."""
    return UserError(moved_message(dotted, value) or f"unknown config key '{dotted}'{_suggest(key, options)}")


def _suggest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(options))})"


def _check_type(key: str, value, default):
    """Returns value coerced to the default's type, or raises naming the key."""
    want = type(default)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, want)
    if not ok:
        raise UserError(f"config key '{key}': expected {want.__name__}, got {value!r} ({type(value).__name__})")
    return value


def merge(base: ConfigDict, user, prefix: str = "") -> None:
    """Merges `user` (ConfigDict or dict) into `base` in place, checking keys and types."""
    for key, value in user.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            if prefix == "mesh.rules.":  # the rule table accepts new logical names
                base[key] = _check_type(dotted, value, ())
                continue
            raise _unknown(dotted, key, base.keys(), value)
        default = base[key]
        if isinstance(default, ConfigDict):
            if not isinstance(value, (ConfigDict, dict)):
                raise UserError(f"config key '{dotted}': expected a section, got {value!r}")
            merge(default, value, dotted + ".")
        else:
            base[key] = _check_type(dotted, value, default)


def _parse_scalar(key: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise UserError(f"config key '{key}': expected true/false, got '{text}'")
    if isinstance(default, (int, float)):
        try:
            return type(default)(text) if isinstance(default, float) else int(text)
        except ValueError:
            raise UserError(f"config key '{key}': expected {type(default).__name__}, got '{text}'") from None
    if isinstance(default, tuple):
        return tuple(s for s in text.split(",") if s)
    return text


def apply_overrides(config: ConfigDict, overrides: list[str]) -> None:
    """Applies `a.b.c=value` strings, typed by the current value of the key."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"override '{item}': expected key=value, e.g. optim.lr=1e-3")
        if message := moved_message(key):  # before the walk: a section may be gone whole
            raise UserError(message)
        node, parts = config, key.split(".")
        for i, part in enumerate(parts):
            dotted = ".".join(parts[: i + 1])
            last = i == len(parts) - 1
            if part not in node:
                if last and dotted.startswith("mesh.rules."):
                    node[part] = ()
                else:
                    raise _unknown(dotted, part, node.keys())
            if last:
                if isinstance(node[part], ConfigDict):
                    raise UserError(f"config key '{dotted}' is a section; set one of its keys")
                node[part] = _parse_scalar(dotted, text, node[part])
            else:
                node = node[part]


def load_file(path: str) -> ConfigDict:
    """A config file's get_config(); every failure is a UserError naming the file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise UserError(f"config file '{path}' does not exist; pass e.g. --config configs/tiny.py")
    spec = importlib.util.spec_from_file_location(f"_lm_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is user input
        raise UserError(f"config file '{path}' failed to load: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_config"):
        raise UserError(f"config file '{path}' has no get_config() function")
    try:
        return module.get_config()
    except Exception as e:
        raise UserError(f"config file '{path}': get_config() failed: {type(e).__name__}: {e}") from None
