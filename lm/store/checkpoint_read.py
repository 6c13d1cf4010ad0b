"""Reading a training checkpoint outside a run, without a Checkpointer: the steps saved under a
directory (from the file system alone), one step's meta item, and the params of one step as numpy
with their checksums verified (what `lm export` and the loaders read). Writing, resuming and
vetting checkpoints during a run is lm.store.checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from lm.errors import UserError
from lm.model.params import leaf_paths
from lm.store.checkpoint_checks import checksums


def saved_steps(directory) -> list[int]:
    """The steps that have a checkpoint directory under `directory`, from the file system alone.

    Cheap and free of orbax, so a run can check --resume against the workdir before it
    spends minutes preparing data; `Checkpointer.restore` still vets each checkpoint.
    """
    d = pathlib.Path(directory)
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []


def read_meta(directory, step: int) -> dict:
    """The meta item of one step (config, shapes, checksums, counters) as a dict."""
    path = pathlib.Path(directory) / str(step) / "meta" / "metadata"
    if not path.is_file():
        raise UserError(f"'{path.parent}' has no checkpoint metadata; is '{directory}' an `lm train` checkpoint dir?")
    return json.loads(path.read_text())


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
        args = ocp.args.PyTreeRestore(
            item={"params": target},
            partial_restore=True,
            restore_args={"params": jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)},
        )
        params = ckptr.restore(step_dir / "state", args=args)["params"]
    saved = dict(zip(meta["shapes"], meta["checksums"]))
    for path, got in zip(leaf_paths({"params": params}), checksums(params, meta.get("checksum_kind"))):
        if saved.get(path) != got:
            raise UserError(
                f"lm export: '{path}' in '{step_dir}' does not match its saved checksum; "
                "the checkpoint is damaged, pick another --step"
            )
    return params, meta, step
