"""The schema, assembled from the sections: every key with its default (whose type is the key's
type), the allowed values, and the checks that run when a config is loaded."""

from __future__ import annotations

import copy

from lm.config import checkpoint, curate, data, distill, dpo, finetune, mesh, model, optim, pairs, reward, rl, train
from lm.config import eval as eval_
from lm.config.core import ConfigDict, apply_overrides, check_choices, load_file, merge

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
    "reward": reward,
    "rl": rl,
    "distill": distill,
    "curate": curate,
}

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


def load_config(path: str | None, overrides: list[str] = ()) -> ConfigDict:
    """Loads a config file's get_config(), merges it over the schema, applies overrides, validates."""
    config = base_config()
    if path:
        merge(config, load_file(path))
    apply_overrides(config, list(overrides))
    validate(config)
    return config


def init_of(config) -> str:
    """The model a run started from (its base, for LoRA adapters): '' for pretraining from scratch."""
    return config.finetune.init or config.train.init
