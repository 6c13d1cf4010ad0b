"""The schema, assembled from the sections: every key with its default (whose type is the key's
type), the allowed values, and the checks that run when a config is loaded."""

from __future__ import annotations

import copy
import dataclasses

from lm.config import (
    checkpoint,
    curate,
    data,
    distill,
    dpo,
    finetune,
    kto,
    mesh,
    model,
    optim,
    pairs,
    reward,
    rft,
    rl,
    train,
)
from lm.config import eval as eval_
from lm.config.core import ConfigDict, apply_overrides, check_choices, load_file, merge
from lm.config.frozen import Section, freeze_into, section_class, thaw

SECTIONS = {
    "model": model,
    "data": data,
    "optim": optim,
    "train": train,
    "eval": eval_,
    "checkpoint": checkpoint,
    "mesh": mesh,
    "finetune": finetune,
    "pairs": pairs,
    "dpo": dpo,
    "kto": kto,
    "reward": reward,
    "rl": rl,
    "rft": rft,
    "distill": distill,
    "curate": curate,
}


def _class_of(name: str, section) -> type:
    """The frozen dataclass of a section (`lm.config.train.Train`, ...), set on its module."""
    cls = section_class(name.title(), section.DEFAULTS, section.__name__)
    for c in (cls, *cls.NESTED.values()):
        setattr(section, c.__name__, c)
    return cls


Config = dataclasses.make_dataclass(
    "Config",
    [(name, _class_of(name, section)) for name, section in SECTIONS.items()],
    bases=(Section,),
    frozen=True,
)
Config.__module__ = __name__
Config.__doc__ = "The frozen config: one frozen dataclass per section (what the code below the CLI reads)."

# "section.key" -> allowed values
CHOICES = {
    f"{name}.{key}": options
    for name, section in SECTIONS.items()
    for key, options in getattr(section, "CHOICES", {}).items()
}


def base_config() -> ConfigDict:
    """Every key with its default. Defaults are the tiny CPU model."""
    return ConfigDict({name: copy.deepcopy(section.DEFAULTS) for name, section in SECTIONS.items()})


def validate(c: ConfigDict) -> None:
    """The allowed values, then each section's consistency checks; each error names the key, value
    and expectation."""
    for name, section in SECTIONS.items():
        check_choices(name, c[name], getattr(section, "CHOICES", {}))
    for section in SECTIONS.values():
        section.check(c)


def freeze(config) -> Config:
    """The frozen `Config` of a built ConfigDict (a Config is returned as it is)."""
    return freeze_into(Config, config)


def with_values(config, values: dict) -> Config:
    """A frozen copy of `config` with dotted keys set ({"train.steps": 10}; a section takes a
    dict), each type-checked as a config file's; `config` itself is never changed."""
    out = thaw(config)
    for key, value in values.items():
        *path, name = key.split(".")
        nested = {name: value.to_dict() if isinstance(value, Section) else value}
        for part in reversed(path):
            nested = {part: nested}
        merge(out, nested)
    return freeze(out)


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Loads a config file's get_config(), merges it over the schema, applies overrides, validates."""
    config = base_config()
    if path:
        merge(config, load_file(path))
    apply_overrides(config, list(overrides))
    validate(config)
    return freeze(config)


def init_of(config) -> str:
    """The model a run started from (its base, for LoRA adapters): '' for pretraining from scratch."""
    return config.finetune.init or config.train.init
