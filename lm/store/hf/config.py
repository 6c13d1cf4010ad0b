"""A Hugging Face model directory as our config, read without jax: is it one, and what its
config.json says in our model section (through the family of its model_type)."""

from __future__ import annotations

import json
import pathlib

from lm.config import base_config, freeze, merge, validate
from lm.errors import UserError
from lm.store.hf.families import family_of


def is_hf_dir(path) -> bool:
    """A directory whose config.json names a model_type (what `save_pretrained` writes)."""
    p = pathlib.Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "model_type" in config


def read_hf_config(path) -> dict:
    """config.json as a dict, whose model_type is a string: one UserError line otherwise."""
    p = pathlib.Path(path) / "config.json"
    try:
        config = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(
            f"{p}: not a readable config.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{p}: expected a JSON object, found {type(config).__name__}")
    if not isinstance(config.get("model_type"), str):
        raise UserError(
            f"{p}: key 'model_type' = {config.get('model_type')!r:.60}: expected a string (the "
            "architecture, e.g. 'llama')"
        )
    return config


def hf_config(path):
    """Our config (frozen) for an HF model directory: its architecture in the model
    section, its own tokenizer (data.tokenizer = the directory); read without params or jax work.
    Every key that changes the model is read or refused (docs/hf.md); the result passes the
    model section's own checks."""
    hf = read_hf_config(path)
    source = f"{pathlib.Path(path) / 'config.json'}"
    family = family_of(hf["model_type"], source)
    keys = family.model_config(hf, source)
    config = base_config()
    config.data.tokenizer = str(pathlib.Path(path))
    try:
        merge(config.model, keys, "model.")
        config.data.seq_len = min(config.data.seq_len, config.model.max_seq_len)
        validate(config)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    return freeze(config)
