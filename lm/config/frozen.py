"""The frozen, typed config that the code below the CLI reads.

A config is built mutable (a ConfigDict: the schema's defaults, a config file merged over them,
dotted overrides, checks) and then frozen: `freeze` turns it into a `Config`, a frozen dataclass
with one frozen dataclass per section. The section classes are generated from each section's
DEFAULTS, so the defaults and types live once; a field's type is its default's type, as the
loader checks. Nothing below the CLI can change a run's config by accident; a variant is a new
value (`with_values`), built and type-checked the same way as a loaded one.
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections


class Section:
    """Read-only access shared by the config and its sections (the generated classes)."""

    def __getitem__(self, key: str):  # for checks that range over key names
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__

    def keys(self) -> list[str]:
        return list(self.__dataclass_fields__)

    def items(self):
        return [(k, getattr(self, k)) for k in self.__dataclass_fields__]

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def to_dict(self) -> dict:
        """Nested plain dicts (tuples stay tuples), as saved with runs and exports."""
        return {k: _plain(v) for k, v in self.items()}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _plain(v):
    if isinstance(v, Section):
        return v.to_dict()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# keys whose value is a mapping that accepts new names (mesh.rules: logical axis -> mesh axes)
OPEN_MAPPINGS = ("rules",)


def _field_type(default):
    if isinstance(default, tuple):
        return tuple[str, ...]
    return type(default)


def section_class(name: str, defaults: dict, module: str) -> type:
    """A frozen dataclass named `name` with a field per key of `defaults` (nested dicts become
    nested classes named `name` + key, except OPEN_MAPPINGS, which stay mappings)."""
    fields, nested = [], {}
    for key, default in defaults.items():
        if isinstance(default, dict) and key not in OPEN_MAPPINGS:
            sub = section_class(name + key.title().replace("_", ""), default, module)
            nested[sub.__name__] = sub
            fields.append((key, sub, dataclasses.field(default_factory=sub)))
        elif isinstance(default, dict):
            fields.append((key, dict, dataclasses.field(default_factory=lambda d=default: dict(d))))
        else:
            fields.append((key, _field_type(default), dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass(name, fields, bases=(Section,), frozen=True)
    cls.__module__ = module  # where pickle finds it: the section module holds it by this name
    cls.NESTED = nested
    return cls


def freeze_into(cls: type, values):
    """An instance of the generated `cls` from a ConfigDict, dict or instance of it."""
    if isinstance(values, cls):
        return values
    given = dict(values.items())
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in given:
            continue
        v = given.pop(f.name)
        if isinstance(f.type, type) and issubclass(f.type, Section):
            v = freeze_into(f.type, v)
        elif f.type is dict:
            v = {k: tuple(x) for k, x in dict(v.items()).items()}
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    if given:
        raise ValueError(f"{cls.__name__}: no field named {', '.join(sorted(given))}")
    return cls(**kwargs)


def thaw(config) -> ml_collections.ConfigDict:
    """A mutable copy (a ConfigDict) of a frozen config or of a ConfigDict."""
    return ml_collections.ConfigDict(config.to_dict())
