"""What a run or an export says about itself, read without jax: its training config and its
tokenizer (kept beside the params).

A run keeps the tokenizer it trained with: a sentencepiece model as WORKDIR/tokenizer.model, a
Hugging Face tokenizer (a model imported from a Hugging Face directory, and every run started
from one) as its files in WORKDIR/tokenizer/ (tokenizer.json, tokenizer_config.json, special
tokens, chat template, generation_config.json); data.tokenizer in its config names where that
tokenizer came from ('byte' for the byte tokenizer). An export keeps the same files beside its
params (lm.store.export)."""

from __future__ import annotations

import json
import pathlib
import shutil

from lm.config import Config, base_config, freeze, init_of, merge, with_values
from lm.config.moved import migrate
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError
from lm.outputs import copy_file, replacing
from lm.store.hf.config import hf_config, is_hf_dir
from lm.store.hf.tokenizer import TOKENIZER_FILES

HF_FILES = TOKENIZER_FILES + ("generation_config.json",)  # a Hugging Face tokenizer as a run or an export keeps it


def tokenizer_beside(path: pathlib.Path) -> pathlib.Path | None:
    """The sentencepiece model kept with a run (WORKDIR/tokenizer.model) or an export
    (EXPORT/tokenizer.model, or NAME.tokenizer.model beside NAME.safetensors), or the Hugging
    Face tokenizer files kept with a run or an export (WORKDIR/tokenizer/, EXPORT/tokenizer/, or
    NAME.tokenizer/)."""
    candidates = [path / "tokenizer.model", path.with_name(path.stem + ".tokenizer.model")]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        folders = [path / "tokenizer", path.with_name(path.stem + ".tokenizer")]
        found = next((p for p in folders if (p / "tokenizer.json").is_file()), None)
    return found


def save_tokenizer(tok, workdir: pathlib.Path) -> None:
    """A run keeps its tokenizer beside the checkpoints (sampling, evaluation, serving, export
    and the runs started from it read it): WORKDIR/tokenizer.model or WORKDIR/tokenizer/; nothing
    for the byte tokenizer, whose name in the config is enough."""
    path = getattr(tok, "path", None)
    if path is not None:
        copy_tokenizer(pathlib.Path(path), pathlib.Path(workdir) / "tokenizer")


def copy_tokenizer(source: pathlib.Path, beside: pathlib.Path) -> pathlib.Path | None:
    """A sentencepiece model (a .model file) copied as BESIDE.model; a Hugging Face tokenizer
    directory's files (HF_FILES) into BESIDE/, which they replace whole (written beside, then
    renamed: never half written). Returns what holds the copy, or None when `source` is neither."""
    if source.suffix == ".model" and source.is_file():
        target = beside.with_name(beside.name + ".model")
        if source.resolve() != target.resolve():
            copy_file(source, target)
        return target
    if not (source / "tokenizer.json").is_file():
        return None
    if source.resolve() != beside.resolve():
        with replacing(beside, directory=True) as tmp:
            tmp.mkdir()
            for name in HF_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / name)
    return beside


def tokenizer_name(tok) -> str:
    """What data.tokenizer records for `tok`: the file or directory it was read from (absolute),
    or its name ('byte')."""
    path = getattr(tok, "path", None)
    return str(pathlib.Path(path).absolute()) if path is not None else tok.name


def with_tokenizer(config, tok) -> Config:
    """A copy of `config` whose data.tokenizer names `tok` (the validated config is never changed)."""
    return with_values(config, {"data.tokenizer": tokenizer_name(tok)})


def trained_with(config, _seen: frozenset = frozenset()) -> str:
    """What the run of `config` names as its tokenizer: data.tokenizer, except in a run written
    before fine-tuning stages recorded theirs ('byte' there, though such a run trains with the
    tokenizer of the model it starts from): then that model's."""
    name, init = config.data.tokenizer, init_of(config)
    if name != "byte" or not init or init in _seen or not pathlib.Path(init).exists():
        return name
    try:
        return tokenizer_source(init, init_config(init), _seen | {init})
    except UserError:
        return name


def _usable(name: str) -> bool:
    return name == "byte" or pathlib.Path(name).exists()  # a .model file or an HF directory


def check_given(tok, expected, given: str, source: str) -> None:
    """--tokenizer GIVEN must be the tokenizer of `source` (`expected`): the same id mapping."""
    if tok.fingerprint() != expected.fingerprint():
        raise UserError(
            f"--tokenizer {given} does not match the tokenizer of {source} "
            f"({tok.fingerprint()} != {expected.fingerprint()}); leave --tokenizer out to use its own"
        )


def tokenizer_for(config, saved: pathlib.Path | None, given: str | None, source: str):
    """The tokenizer of a run or an export: the one kept beside it (`saved`), else the one its
    config names; `given` (--tokenizer) must be that one, or is used as it is when neither exists."""
    own = str(saved) if saved is not None else trained_with(config)
    if given:
        tok = load_tokenizer(given)
        if _usable(own):
            check_given(tok, load_tokenizer(own), given, source)
    elif _usable(own):
        tok = load_tokenizer(own)
    else:
        raise UserError(
            f"{source}: no tokenizer beside it and data.tokenizer='{own}' does not exist; "
            "pass --tokenizer PATH.model (or a Hugging Face tokenizer directory)"
        )
    if tok.vocab_size > config.model.vocab_size:
        raise UserError(
            f"the tokenizer has {tok.vocab_size} ids but {source} has model.vocab_size="
            f"{config.model.vocab_size}: it is not the model's tokenizer"
        )
    return tok


def config_from(saved: dict, source: str):
    if not saved:
        raise UserError(f"{source} carries no config; it was not written by `lm train` / `lm export`")
    config = base_config()
    merge(config, migrate(saved))  # a config saved before keys moved reads as today's
    return freeze(config)


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


def tokenizer_source(path: str, config, _seen: frozenset = frozenset()) -> str:
    """What data.tokenizer must name to tokenize text for the model in `path` (its config given):
    a Hugging Face directory itself, the tokenizer kept beside a run or an export (tokenizer.model
    or tokenizer/), or the tokenizer it was trained with ('byte', a .model file or a directory)."""
    p = pathlib.Path(path)
    if is_hf_dir(p):
        return str(p)
    beside = tokenizer_beside(p)
    if beside is not None:
        return str(beside)
    name = trained_with(config, _seen)
    if _usable(name):
        return name
    raise UserError(f"'{path}': no tokenizer beside it and data.tokenizer='{name}' does not exist")
