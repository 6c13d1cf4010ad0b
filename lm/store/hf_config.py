"""A Hugging Face model directory as our config, read without jax: is it one, and what its
config.json says in our model section (through the family of its model_type)."""

from __future__ import annotations

import json
import pathlib

from lm.config import base_config
from lm.errors import UserError
from lm.model.families import family_of


def is_hf_dir(path) -> bool:
    """A directory whose config.json names a model_type (what `save_pretrained` writes)."""
    p = pathlib.Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        return "model_type" in json.loads((p / "config.json").read_text())
    except ValueError:
        return False


def read_hf_config(path) -> dict:
    p = pathlib.Path(path) / "config.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{p}: not a readable config.json: {e}") from None


def hf_config(path):
    """Our config (a ConfigDict) for an HF model directory: its architecture in the model
    section, its own tokenizer (data.tokenizer = the directory); read without params or jax work."""
    hf = read_hf_config(path)
    source = f"{pathlib.Path(path) / 'config.json'}"
    family = family_of(hf.get("model_type", "?"), source)
    config = base_config()
    for key, value in family.model_config(hf, source).items():
        config.model[key] = value
    config.data.tokenizer = str(pathlib.Path(path))
    config.data.seq_len = min(config.data.seq_len, config.model.max_seq_len)
    return config
