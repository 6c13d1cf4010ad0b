"""A trained model for inference or as a starting point: its config, params and tokenizer, from a run
(its newest checkpoint) or an export (lm.store.export)."""

from __future__ import annotations

import concurrent.futures
import contextvars
import pathlib
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

from lm.config import init_of, rules_table, with_values
from lm.data.tokenizer import load_tokenizer
from lm.errors import UserError
from lm.model.build import build_model
from lm.model.lora import merge_lora
from lm.model.params import leaf_paths, merge_trees
from lm.model.quant import SUFFIXES, from_tensors
from lm.store.checkpoint_checks import quiet_background_threads
from lm.store.checkpoint_read import read_checkpoint_params, saved_steps
from lm.store.hf.reader import is_hf_dir, load_hf
from lm.store.loaded import Loaded
from lm.store.meta import check_given, config_from, saved_config, tokenizer_beside, tokenizer_for
from lm.store.safetensors_files import check_finite

__all__ = ["Loaded", "load_trained", "load_init", "load_params", "with_base"]


def load_trained(
    workdir: str | None = None,
    params: str | None = None,
    tokenizer: str | None = None,
    step: int | None = None,
    merge_adapters: bool = True,
) -> Loaded:
    """From an `lm train` workdir (its newest checkpoint, or `step`), an `lm export` (dir or
    .safetensors) or a Hugging Face model directory (lazy params: lm.store.hf.reader). A LoRA model's
    adapters are folded into its base unless merge_adapters=False (then its params and config
    are as saved: the adapters, alone or beside the base, and model.lora_rank > 0)."""
    if (workdir is None) == (params is None):
        raise UserError("give exactly one of --workdir RUN or --params EXPORT_OR_HF_DIR")
    if params is not None and is_hf_dir(params):
        if tokenizer and any((pathlib.Path(params) / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
            check_given(load_tokenizer(tokenizer), load_tokenizer(params), tokenizer, f"'{params}'")
        return load_hf(params, tokenizer)
    if workdir is not None:
        _check_run(pathlib.Path(workdir), step)
        values, meta, step = off_main_thread(read_checkpoint_params, workdir, step)
        source = f"run '{workdir}' (step {step})"
        config, path = config_from(meta.get("config"), source), pathlib.Path(workdir)
    else:
        path = pathlib.Path(params)
        if not path.exists():
            raise UserError(f"--params {params}: no such file or directory (an `lm export` output)")
        values, source = load_params(path), f"export '{params}'"
        config = config_from(saved_config(path), source)
    check_finite(values, source)
    if quantized(values):
        values = from_tensors(
            dict(zip(leaf_paths(values), jax.tree.leaves(values))),
            build_model(config, jax.devices()[:1], rules=rules_table(config)).abstract_params(),
        )
    tok = tokenizer_for(config, tokenizer_beside(path), tokenizer, source)
    if config.model.lora_rank > 0 and merge_adapters:
        config, values = with_base(config, values, source)
    return Loaded(config, values, tok, source)


def _check_run(workdir: pathlib.Path, step: int | None) -> None:
    """A UserError, worded for any command that reads a run, unless `workdir` holds a checkpoint
    (of `step`, when given)."""
    steps = saved_steps(workdir / "checkpoints")
    if steps and (step is None or step in steps):
        return
    if steps:
        raise UserError(f"'{workdir}' has no checkpoint of step {step} (saved steps: {steps})")
    if not workdir.exists():
        raise UserError(
            f"'{workdir}' does not exist; give a run directory with checkpoints (what `lm train "
            "--workdir` writes) or an export with --params"
        )
    if is_hf_dir(workdir):
        raise UserError(
            f"'{workdir}' is a Hugging Face model directory, not a run directory: give it with --params '{workdir}'"
        )
    if (workdir / "params").is_dir() or workdir.suffix == ".safetensors":
        raise UserError(f"'{workdir}' is an export, not a run directory: give it with --params '{workdir}'")
    raise UserError(
        f"'{workdir}' holds no checkpoint (no {workdir / 'checkpoints'}/STEP) and no export; give a "
        "run directory with checkpoints (what `lm train --workdir` writes) or an export with --params"
    )


def with_base(config, params: dict, source: str):
    """A LoRA run's params are its adapters alone: fold them into the base it was trained from
    (finetune.init) -> (the config without adapters, plain params as numpy)."""
    if "embedding" not in params:
        if not init_of(config):
            raise UserError(f"{source} holds LoRA adapters but names no base model (finetune.init is empty)")
        params = merge_trees(params, load_init(init_of(config)).params)
    m = config.model
    merged = jax.tree.map(np.asarray, merge_lora(params, m.lora_alpha, m.lora_rank))
    return with_values(config, {"model.lora_rank": 0, "model.lora_base_quant": "none"}), merged


def load_init(init: str) -> Loaded:
    """The model a fine-tuning run starts from: an `lm train`/`lm sft` workdir (its newest
    checkpoint), an `lm export` or a Hugging Face model directory."""
    if not init:
        raise UserError(
            "no model to start from (init is empty); give --init RUN_OR_EXPORT (an `lm train` workdir, "
            "an `lm export` or a Hugging Face model directory)"
        )
    path = pathlib.Path(init)
    if not path.exists():
        raise UserError(
            f"--init {init}: no such file or directory; expected an `lm train` workdir, an `lm export` "
            "or a Hugging Face model directory"
        )
    if (path / "checkpoints").is_dir():
        return load_trained(workdir=init)
    return load_trained(params=init)


def load_params(path) -> dict:
    """The params tree (nested dict of numpy arrays) from either export layout."""
    path = pathlib.Path(path)
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors.numpy import load_file

        tree: dict = {}
        for name, array in load_file(str(path)).items():
            node = tree
            *parents, leaf = name.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = array
        return tree
    if (path / "params").is_dir():
        return off_main_thread(_read_export, (path / "params").absolute())
    raise UserError(f"'{path}' is neither a .safetensors file nor an `lm export` directory (PATH/params/)")


def _read_export(directory: pathlib.Path) -> dict:
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(directory).item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return ckptr.restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def off_main_thread(read, *args):
    """read(*args) on a worker thread, waited for here. A signal's exception (a stop) is raised in
    the main thread: it then lands in this wait, not inside orbax's event loop, where it would
    abandon half-made loops and reads that print tracebacks as they are collected. The worker is
    left to end with the process."""
    quiet_background_threads()
    result, context = concurrent.futures.Future(), contextvars.copy_context()

    def work():
        try:
            result.set_result(context.run(read, *args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread as it is
            result.set_exception(e)

    threading.Thread(target=work, name="lm-read-model", daemon=True).start()
    return result.result()


def quantized(tree: dict) -> bool:
    """Whether a params tree read from an export holds quantized weights ('wq.q8', 'wq.scale', ...)."""
    return any(isinstance(v, dict) and quantized(v) or k.endswith(tuple(SUFFIXES.values())) for k, v in tree.items())
