"""`lm export`: the params of one training checkpoint, alone, for inference and fine-tuning.

Two layouts, the same tensors (float32, exactly as trained; the layers are stacked on a
leading axis of size n_layers because the blocks are scanned, whatever the remat policy):

- orbax (PATH is a directory):
    PATH/params/       an orbax PyTree checkpoint of the params tree, e.g. params['blocks']['attn']['wq']
                       with shape [n_layers, d_model, n_heads, head_dim]
    PATH/config.json   the resolved training config (rebuild the model with it)
    PATH/export.json   {"step": ..., "checkpoint": ...}
- safetensors (PATH ends in .safetensors): one file; each tensor is named by its params-tree
  path joined with '/', e.g. 'blocks/attn/wq'; the header metadata holds 'lm_config' (the
  config as JSON) and 'lm_step'.

A run trained with a sentencepiece tokenizer also gets its tokenizer beside the params:
PATH/tokenizer.model, or NAME.tokenizer.model beside NAME.safetensors (`lm sample` reads it).

`load_params(path)` reads either back as a nested dict of numpy arrays.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from lm.errors import UserError
from lm.train.checkpoint import checksums, leaf_paths, read_meta


def _step_dir(workdir: pathlib.Path, step: int | None) -> tuple[pathlib.Path, int]:
    root = pathlib.Path(workdir) / "checkpoints"
    steps = sorted(int(p.name) for p in root.glob("*") if p.is_dir() and p.name.isdigit()) if root.is_dir() else []
    if not steps:
        raise UserError(f"lm export: no checkpoint in '{root}'; train first with `lm train --workdir {workdir}`")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"lm export: --step {step} is not in '{root}' (available: {steps})")
    return root / str(step), step


class _DropStepMetadataWarning(logging.Filter):
    """A training checkpoint keeps orbax's step metadata beside its items (STEP/), not inside
    them: reading one item (STEP/state) on its own makes orbax look for it in the item and log
    a warning about a file that was never meant to be there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Metadata file does not exist")


@contextlib.contextmanager
def _reading_one_item():
    logger, quiet = logging.getLogger("absl"), _DropStepMetadataWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def read_checkpoint_params(workdir, step: int | None = None) -> tuple[dict, dict, int]:
    """(params as numpy, meta, step) from a training checkpoint; checksums are verified."""
    step_dir, step = _step_dir(pathlib.Path(workdir).absolute(), step)  # orbax needs absolute paths
    meta = read_meta(step_dir.parent, step)
    ckptr = ocp.PyTreeCheckpointer()
    with _reading_one_item():
        tree = ckptr.metadata(step_dir / "state").item_metadata.tree["params"]
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
        args = ocp.args.PyTreeRestore(item={"params": target}, partial_restore=True, restore_args={
            "params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)})
        params = ckptr.restore(step_dir / "state", args=args)["params"]
    saved = dict(zip(meta["shapes"], meta["checksums"]))
    for path, got in zip(leaf_paths({"params": params}), checksums(params)):
        if saved.get(path) != got:
            raise UserError(f"lm export: '{path}' in '{step_dir}' does not match its saved checksum; "
                            "the checkpoint is damaged, pick another --step")
    return params, meta, step


def export_params(workdir, out, step: int | None = None, fmt: str | None = None, merge: bool = False) -> dict:
    """Writes the params of `step` (default: newest) to `out`; returns a short summary.

    A LoRA run's checkpoints hold its adapters alone: they are exported alone (with the config
    naming their base, sft.init), or with merge=True folded into the base as a plain model."""
    out = pathlib.Path(out)
    if fmt is None and out.suffix not in ("", ".safetensors"):
        raise UserError(f"lm export: --out {out}: a '{out.suffix}' file is neither form lm writes; give a file "
                        "ending in .safetensors, or a directory path without a suffix (orbax layout)")
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "orbax")
    if fmt not in ("orbax", "safetensors"):
        raise UserError(f"lm export: --format {fmt!r}: expected 'orbax' or 'safetensors'")
    params, meta, step = read_checkpoint_params(workdir, step)
    saved = meta.get("config") or {}
    if merge:
        if not saved.get("model", {}).get("lora_rank"):
            raise UserError(f"lm export --merge: '{workdir}' has no LoRA adapters to merge (model.lora_rank=0)")
        from lm.config import base_config, merge as merge_config
        from lm.infer.load import with_base

        full = base_config()
        merge_config(full, saved)
        plain, params = with_base(full, params, f"run '{workdir}'")
        saved = plain.to_dict()
    config = json.dumps(saved)
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        out.parent.mkdir(parents=True, exist_ok=True)
        flat = {p: np.ascontiguousarray(x) for p, x in zip(leaf_paths(params), jax.tree.leaves(params))}
        save_file(flat, str(out), metadata={"lm_config": config, "lm_step": str(step)})
        tokenizer_out = out.with_name(out.stem + ".tokenizer.model")
    else:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        ckptr = ocp.PyTreeCheckpointer()
        ckptr.save((out / "params").absolute(), args=ocp.args.PyTreeSave(params))
        ckptr.close()
        (out / "config.json").write_text(config)
        (out / "export.json").write_text(json.dumps({"step": step, "checkpoint": str(pathlib.Path(workdir).absolute())}))
        tokenizer_out = out / "tokenizer.model"
    tokenizer = pathlib.Path(workdir) / "tokenizer.model"  # a sentencepiece run's; byte runs have none
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, tokenizer_out)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {"step": step, "format": fmt, "params": n, "out": str(out)}


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
        ckptr = ocp.PyTreeCheckpointer()
        tree = ckptr.metadata((path / "params").absolute()).item_metadata.tree
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return ckptr.restore((path / "params").absolute(), args=ocp.args.PyTreeRestore(restore_args=restore_args))
    raise UserError(f"'{path}' is neither a .safetensors file nor an `lm export` directory (PATH/params/)")


def load_config(path) -> dict:
    """The training config stored with an export, as a dict."""
    path = pathlib.Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            return json.loads(f.metadata()["lm_config"])
    return json.loads((path / "config.json").read_text())
