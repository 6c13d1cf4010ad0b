"""What a run or an export says about itself, read without jax: its training config and its
tokenizer (kept beside the params)."""

from __future__ import annotations

import json
import pathlib
import shutil

from lm.config import base_config, merge
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError
from lm.store.hf_config import hf_config, is_hf_dir


def tokenizer_beside(path: pathlib.Path) -> pathlib.Path | None:
    """The sentencepiece model kept with a run (WORKDIR/tokenizer.model) or an export
    (EXPORT/tokenizer.model, or NAME.tokenizer.model beside NAME.safetensors), or the Hugging
    Face tokenizer files kept with an export (EXPORT/tokenizer/, or NAME.tokenizer/)."""
    candidates = [path / "tokenizer.model", path.with_name(path.stem + ".tokenizer.model")]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        folders = [path / "tokenizer", path.with_name(path.stem + ".tokenizer")]
        found = next((p for p in folders if (p / "tokenizer.json").is_file()), None)
    return found


def save_tokenizer(tok, workdir: pathlib.Path) -> None:
    """A sentencepiece run keeps its model beside the checkpoints (sampling and export read it)."""
    path = getattr(tok, "path", None)
    if path is not None and pathlib.Path(path).suffix == ".model":
        target = pathlib.Path(workdir) / "tokenizer.model"
        if pathlib.Path(path).resolve() != target.resolve():
            shutil.copyfile(path, target)


def tokenizer_for(config, saved: pathlib.Path | None, given: str | None, source: str):
    trained_with = config.data.tokenizer
    if given:
        tok = load_tokenizer(given)
        if saved is not None:
            expected = load_tokenizer(str(saved)).fingerprint()
        elif trained_with == "byte" or pathlib.Path(trained_with).exists():
            expected = load_tokenizer(trained_with).fingerprint()
        else:
            expected = None
        if expected is not None and tok.fingerprint() != expected:
            raise UserError(f"--tokenizer {given} does not match the tokenizer {source} was trained with "
                            f"({tok.fingerprint()} != {expected}); leave --tokenizer out to use the run's own")
    elif saved is not None:
        tok = load_tokenizer(str(saved))
    elif trained_with == "byte" or pathlib.Path(trained_with).exists():  # a .model file or an HF directory
        tok = load_tokenizer(trained_with)
    else:
        raise UserError(f"{source}: no tokenizer beside it and data.tokenizer='{trained_with}' does not exist; "
                        "pass --tokenizer PATH.model (or a Hugging Face tokenizer directory)")
    if tok.vocab_size > config.model.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but {source} has model.vocab_size="
                        f"{config.model.vocab_size}: it is not the model's tokenizer")
    return tok


def config_from(saved: dict, source: str):
    if not saved:
        raise UserError(f"{source} carries no config; it was not written by `lm train` / `lm export`")
    config = base_config()
    merge(config, saved)
    return config


def saved_config(path) -> dict | None:
    """The training config a run or an export holds, as a dict (None when it carries none)."""
    p = pathlib.Path(path)
    if p.suffix == ".safetensors" and p.is_file():
        from safetensors import safe_open

        with safe_open(str(p), framework="numpy") as f:
            return json.loads((f.metadata() or {}).get("lm_config", "null"))
    if (p / "config.json").is_file():
        return json.loads((p / "config.json").read_text())
    raise UserError(f"'{path}' is neither an `lm train`/`lm sft` workdir nor an `lm export` (no config.json)")


def init_config(path: str):
    """The config a run or an export was trained with (for a Hugging Face model directory: its
    architecture and tokenizer), read without loading params."""
    if is_hf_dir(path):
        return hf_config(path)
    return config_from(saved_config(path), f"'{path}'")


def tokenizer_source(path: str, config) -> str:
    """What data.tokenizer must name to tokenize text for the model in `path` (its config given):
    a Hugging Face directory itself, the tokenizer.model kept beside a run or an export, or the
    tokenizer it was trained with ('byte' or a .model file)."""
    p = pathlib.Path(path)
    if is_hf_dir(p):
        return str(p)
    beside = tokenizer_beside(p)
    if beside is not None:
        return str(beside)
    trained_with = config.data.tokenizer
    if trained_with == "byte" or pathlib.Path(trained_with).exists():  # a .model file or an HF directory
        return trained_with
    raise UserError(f"'{path}': no tokenizer beside it and data.tokenizer='{trained_with}' does not exist")
