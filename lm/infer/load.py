"""A trained model for inference: its config, params and tokenizer, from a run or an export."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from lm.config import ConfigDict, base_config, init_of, merge
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError


@dataclasses.dataclass
class Loaded:
    config: object  # the training config (ConfigDict)
    params: dict  # numpy arrays
    tokenizer: object
    source: str  # what was loaded, for messages


def tokenizer_beside(path: pathlib.Path) -> pathlib.Path | None:
    """The sentencepiece model kept with a run (WORKDIR/tokenizer.model) or an export
    (EXPORT/tokenizer.model, or NAME.tokenizer.model beside NAME.safetensors)."""
    candidates = [path / "tokenizer.model", path.with_name(path.stem + ".tokenizer.model")]
    return next((p for p in candidates if p.is_file()), None)


def save_tokenizer(tok, workdir: pathlib.Path) -> None:
    """A sentencepiece run keeps its model beside the checkpoints (sampling and export read it)."""
    path = getattr(tok, "path", None)
    if path is not None and pathlib.Path(path).suffix == ".model":
        target = pathlib.Path(workdir) / "tokenizer.model"
        if pathlib.Path(path).resolve() != target.resolve():
            shutil.copyfile(path, target)


def _tokenizer(config, saved: pathlib.Path | None, given: str | None, source: str):
    trained_with = config.data.tokenizer
    if given:
        tok = load_tokenizer(given)
        if saved is not None:
            expected = load_tokenizer(str(saved)).fingerprint()
        elif trained_with == "byte" or pathlib.Path(trained_with).is_file():
            expected = load_tokenizer(trained_with).fingerprint()
        else:
            expected = None
        if expected is not None and tok.fingerprint() != expected:
            raise UserError(f"--tokenizer {given} does not match the tokenizer {source} was trained with "
                            f"({tok.fingerprint()} != {expected}); leave --tokenizer out to use the run's own")
    elif saved is not None:
        tok = load_tokenizer(str(saved))
    elif trained_with == "byte" or pathlib.Path(trained_with).is_file():
        tok = load_tokenizer(trained_with)
    else:
        raise UserError(f"{source}: no tokenizer.model beside it and data.tokenizer='{trained_with}' is not a file; "
                        "pass --tokenizer PATH.model")
    if tok.vocab_size > config.model.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but {source} has model.vocab_size="
                        f"{config.model.vocab_size}: it is not the model's tokenizer")
    return tok


def _config(saved: dict, source: str):
    if not saved:
        raise UserError(f"{source} carries no config; it was not written by `lm train` / `lm export`")
    config = base_config()
    merge(config, saved)
    return config


def init_config(path: str):
    """The config a run or an export was trained with, read without loading params (or jax)."""
    p = pathlib.Path(path)
    if p.suffix == ".safetensors" and p.is_file():
        from safetensors import safe_open

        with safe_open(str(p), framework="numpy") as f:
            saved = json.loads((f.metadata() or {}).get("lm_config", "null"))
    elif (p / "config.json").is_file():
        saved = json.loads((p / "config.json").read_text())
    else:
        raise UserError(f"'{path}' is neither an `lm train`/`lm sft` workdir nor an `lm export` (no config.json)")
    return _config(saved, f"'{path}'")


def load_trained(workdir: str | None = None, params: str | None = None, tokenizer: str | None = None,
                 step: int | None = None) -> Loaded:
    """From an `lm train` workdir (its newest checkpoint, or `step`) or an `lm export` (dir or .safetensors)."""
    from lm import export  # lazy: orbax

    if (workdir is None) == (params is None):
        raise UserError("give exactly one of --workdir RUN or --params EXPORT")
    if workdir is not None:
        values, meta, step = export.read_checkpoint_params(workdir, step)
        source = f"run '{workdir}' (step {step})"
        config, path = _config(meta.get("config"), source), pathlib.Path(workdir)
    else:
        path = pathlib.Path(params)
        if not path.exists():
            raise UserError(f"--params {params}: no such file or directory (an `lm export` output)")
        values, source = export.load_params(path), f"export '{params}'"
        config = _config(export.load_config(path), source)
    tok = _tokenizer(config, tokenizer_beside(path), tokenizer, source)
    if config.model.lora_rank > 0:
        config, values = with_base(config, values, source)
    return Loaded(config, values, tok, source)


def with_base(config, params: dict, source: str):
    """A LoRA run's params are its adapters alone: fold them into the base it was trained from
    (config.sft.init or config.pairs.init) -> (the config without adapters, plain params as numpy)."""
    import jax
    import numpy as np

    from lm.model.lora import merge_lora
    from lm.train.state import merge_trees

    if "embedding" not in params:
        if not init_of(config):
            raise UserError(f"{source} holds LoRA adapters but names no base model (sft.init, pairs.init and rl.init are empty)")
        params = merge_trees(params, load_init(init_of(config)).params)
    m = config.model
    merged = jax.tree.map(np.asarray, merge_lora(params, m.lora_alpha, m.lora_rank))
    plain = ConfigDict(config.to_dict())
    plain.model.lora_rank = 0
    return plain, merged


def load_init(init: str) -> Loaded:
    """The model a fine-tuning run starts from: an `lm train`/`lm sft` workdir (its newest
    checkpoint) or an `lm export`."""
    if not init:
        raise UserError("no model to start from (init is empty); give --init RUN_OR_EXPORT (an `lm train` workdir or an `lm export`)")
    path = pathlib.Path(init)
    if not path.exists():
        raise UserError(f"--init {init}: no such file or directory; expected an `lm train` workdir or an `lm export`")
    if (path / "checkpoints").is_dir():
        return load_trained(workdir=init)
    return load_trained(params=init)
