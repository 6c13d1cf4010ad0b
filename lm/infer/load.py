"""A trained model for inference: its config, params and tokenizer, from a run or an export."""

from __future__ import annotations

import dataclasses
import pathlib

from lm.config import base_config, merge
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
    return Loaded(config, values, _tokenizer(config, tokenizer_beside(path), tokenizer, source), source)
