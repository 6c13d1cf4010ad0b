"""Orbax checkpoints of the whole run: TrainState (sharded) + the data iterator state."""

from __future__ import annotations

import pathlib

import grain
import orbax.checkpoint as ocp

from lm.errors import UserError


class Checkpointer:
    """Saves every `every_steps`, keeps the newest `keep`; restores onto the given shardings."""

    def __init__(self, directory: pathlib.Path, every_steps: int, keep: int):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(save_interval_steps=max(every_steps, 1), max_to_keep=keep,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iter, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=grain.checkpoint.CheckpointSave(data_iter))
        return self.manager.save(step, args=args, force=force)

    def restore(self, abstract_state, data_iter):
        """Restores the newest checkpoint into `abstract_state`'s shardings and `data_iter` in place."""
        step = self.latest_step()
        if step is None:
            raise UserError(f"--resume: no checkpoint in '{self.directory}'; run without --resume to start fresh")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  data=grain.checkpoint.CheckpointRestore(data_iter))
        restored = self.manager.restore(step, args=args)
        return restored["state"], step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
