"""Orbax checkpoints of the whole run, and restoring them safely.

One checkpoint is a step directory with three items written together:
  state/  the TrainState (step, params, optimizer state, rng), sharded, one layout whatever
          the mesh or remat policy (layers are always scanned: a leading `layers` axis);
  data/   the grain iterator state of each process, process_I-of-N.json (a resumed run sees
          exactly the batches, or RL prompts, it would have seen); a run resumed on another
          number of processes regroups them by batch row (lm.data.pipeline.regroup_state);
  meta/   JSON: the resolved config, the run's identity (lm.train.identity), the shape and
          checksum of every state leaf, the sha256 of every process's data state, the digest of
          metrics.jsonl so far, the loop's fault counters, and a sha256 of itself
          (lm.store.checkpoint_checks).
Orbax writes each step to a temporary directory and renames it when complete, so a crash,
a kill or a full disk during a save never touches the checkpoints already there.

On resume the newest checkpoint is checked (meta readable and equal to its digest, made by this
run, shapes match the config, every array restorable, state checksums and data digests equal);
if damaged, the next newest is tried, and once one is restored the damaged newer ones are moved
to `rejected_checkpoints/` with a one-line warning naming the fault and the file. Only damage
sets a checkpoint aside: another run's checkpoint, shapes that do not fit the config, a data
position that cannot be regrouped for this number of processes (a wrong setup), a permission or I/O error (the
storage, not the files) end the resume with one line and move nothing; so does a resume that
finds no intact checkpoint. A checkpoint written before meta and data digests existed is
restored with a warning that they are unchecked.

With checkpoint.local_dir, a second tier saves each process's shards to a fast local disk more
often (lm.store.local_tier); a resume takes the newest step that every process holds complete
there when it is newer than the persistent tier's newest, and the persistent tier otherwise (or
when the local step does not read back intact on some process).

Reading a checkpoint outside a run (its steps, one step's meta, its params) is lm.store.checkpoint_read.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import time
from typing import Callable

import grain
import jax
import orbax.checkpoint as ocp

from lm.data.pipeline import regroup_state
from lm.errors import UserError
from lm.model.params import leaf_paths
from lm.store.checkpoint_checks import (
    HASH,
    Damaged,
    access_fault,
    checksums,
    data_checksums,
    data_file,
    describe,
    quiet_background_threads,
    seal,
    verify_array_files,
    verify_data,
    verify_meta,
)
from lm.store.checkpoint_compat import IncompatibleCheckpoint, check_compatible, shapes
from lm.store.local_tier import LocalTier, any_process

ITEMS = ("state", "data", "meta")


class Checkpointer:
    """Saves when asked (the loop decides when), keeps the newest `keep` plus every
    `keep_period`-th step, and restores onto any target shardings."""

    def __init__(
        self,
        directory,
        every_steps: int = 100,
        keep: int = 3,
        *,
        every_minutes: float = 0.0,
        keep_period: int = 0,
        config=None,
        identity: dict | None = None,
        accept: Callable[[int, dict], None] | None = None,
        metrics_digest: Callable[[], str] | None = None,
        local: LocalTier | None = None,
    ):
        """identity: recorded in every meta; accept(step, meta): raises (a UserError) for a checkpoint
        this run must not restore; metrics_digest(): the digest of metrics.jsonl so far."""
        self.directory = pathlib.Path(directory).absolute()
        self.identity, self.accept, self.metrics_digest = identity, accept, metrics_digest
        self.local = local
        self.rejected_dir = self.directory.parent / "rejected_checkpoints"
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.config = json.loads(config.to_json()) if config is not None else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_period or None,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._last_save = time.monotonic()
        self._pending_step = None  # the step whose asynchronous save may still be running
        quiet_background_threads()

    @classmethod
    def from_config(cls, directory, config, **kw) -> "Checkpointer":
        k = config.checkpoint
        local = None
        if k.local_dir:
            local = LocalTier(k.local_dir, k.local_every_steps, k.local_keep, identity=kw.get("identity"))
        return cls(
            directory,
            k.every_steps,
            k.keep,
            every_minutes=k.every_minutes,
            keep_period=k.keep_period,
            config=config,
            local=local,
            **kw,
        )

    # ---- saving ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def time_due(self) -> bool:
        return self.every_minutes > 0 and time.monotonic() - self._last_save >= 60 * self.every_minutes

    def local_due(self, step: int) -> bool:
        return self.local is not None and self.local.due(step)

    def latest_step(self) -> int | None:
        steps = [self.manager.latest_step()] + (self.local.complete_steps()[-1:] if self.local is not None else [])
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_iter, health: dict | None = None, local_only: bool = False) -> None:
        """Starts an async save of everything at `step`; returns once the arrays are copied off device.
        A failure of the previous save is reported first, under that save's step. local_only: to
        the local tier alone."""
        self.wait()
        if local_only:
            extra = {"health": health, "metrics_digest": self.metrics_digest() if self.metrics_digest else None}
            with self._reporting(step):
                self.local.save(step, state, data_iter.get_state(), extra)
            self._pending_step = step
            return
        meta = seal(
            {
                "step": int(step),
                "shapes": shapes(state),
                "checksum_kind": HASH,
                "checksums": checksums(state),
                "data_checksums": data_checksums(data_iter),
                "config": self.config,
                "identity": self.identity,
                "metrics_digest": self.metrics_digest() if self.metrics_digest else None,
                "health": health,
            }
        )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta),
        )
        with self._reporting(step):
            self.manager.save(step, args=args, force=True)
        self._last_save, self._pending_step = time.monotonic(), step

    def wait(self) -> None:
        with self._reporting(self._pending_step):
            self.manager.wait_until_finished()
            if self.local is not None:
                self.local.wait()
        self._pending_step = None

    def close(self) -> None:
        self.wait()
        self.manager.close()
        if self.local is not None:
            self.local.close()

    @contextlib.contextmanager
    def _reporting(self, step):
        """Turns a failed write (disk full, permissions, ...) into one clear line; orbax wrote into
        a temporary directory, so the checkpoints already there are untouched."""
        try:
            yield
        except UserError:
            raise
        except Exception as error:
            self._pending_step = None  # reported once; the manager has given up on that save
            steps = [s for s in self.all_steps() if s != step]
            then = (
                "then run the same command with --resume"
                if steps
                else f"then run the same command again without --resume (no checkpoint was saved yet; move "
                f"'{self.directory}' aside first if it is there)"
            )
            kept = f"the checkpoints already there are intact (steps {steps})" if steps else "no checkpoint is saved"
            raise UserError(
                f"saving the checkpoint of step {step} in '{self.directory}' failed: "
                f"{describe(error)}; {kept}; free space or fix permissions, {then}"
            ) from error

    # ---- restoring -------------------------------------------------------------------------

    def restore(self, abstract_state, data_iter=None, step: int | None = None):
        """Restores the newest intact checkpoint (or `step`) onto `abstract_state`'s shardings, and
        `data_iter` in place when given. Damaged checkpoints are set aside with a warning.

        Returns (state, step, meta) where meta holds the saved config and fault counters.
        Only damage sets a checkpoint aside, and only once an older one is restored: a refusal
        (UserError), a permission or I/O error, or no intact checkpoint at all moves nothing.
        """
        if step is None and self.local is not None:
            restored = self._restore_local(abstract_state, data_iter)
            if restored is not None:
                return restored
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise UserError(f"--resume: no checkpoint in '{self.directory}'; run without --resume to start fresh")
        damaged = []
        for s in steps:
            try:
                state, meta = self._restore_checked(s, abstract_state, data_iter)
            except UserError:
                raise  # a wrong setup, not a damaged file
            except Exception as e:  # damage (missing files, garbage bytes, bad metadata), or the storage
                reason = describe(e, self.directory / str(s))
                fault = access_fault(e)
                if fault:
                    raise UserError(
                        f"checkpoint step {s} in '{self.directory}' cannot be read ({fault}: {reason}); "
                        "nothing was moved; fix the permissions or the storage, then run the same "
                        "command with --resume again"
                    ) from None
                damaged.append((s, reason))
                continue
            for bad, reason in damaged:
                self._reject(bad, reason, s)
            return state, s, meta
        problems = "; ".join(f"step {s}: {reason}" for s, reason in damaged)
        raise UserError(
            f"no intact checkpoint in '{self.directory}' ({problems}); nothing was moved; to train "
            f"again from the start, move it aside (mv '{self.directory}' '{self.directory}.damaged') "
            "and run the same command without --resume"
        )

    def _restore_local(self, abstract_state, data_iter):
        """(state, step, meta) from the local tier's newest step complete on every process, when it is
        newer than the persistent tier's; None to restore from the persistent tier."""
        step, newest = self.local.agreed_step(), self.manager.latest_step()
        if step is None or (newest is not None and newest >= step):
            return None
        try:
            shards, meta, problem = *self.local.read(step, abstract_state), None
        except ValueError as e:
            shards, meta, problem = None, None, str(e)
        if any_process(problem is not None):
            print(
                f"lm: warning: local checkpoint step {step} in '{self.local.directory}' is not used "
                f"({problem or 'damaged on another process'}); restoring from '{self.directory}'",
                flush=True,
            )
            return None
        state = self.local.build(shards, abstract_state)
        if data_iter is not None:
            data_iter.set_state(meta["data"])
        print(f"lm: restored local checkpoint step {step} from '{self.local.directory}'", flush=True)
        return state, step, meta

    def _restore_checked(self, step: int, abstract_state, data_iter):
        step_dir = self.directory / str(step)
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except FileNotFoundError as e:
            raise Damaged(f"meta '{step}/meta/metadata' is missing") from e
        except Exception as e:
            raise Damaged(f"meta '{step}/meta/metadata' cannot be read ({describe(e)})") from e
        if not isinstance(meta, dict) or not {"shapes", "checksums"} <= meta.keys():
            raise Damaged(f"meta '{step}/meta/metadata' lacks shapes/checksums")
        sealed = "meta_checksum" in meta
        if sealed:
            verify_meta(meta, step_dir)
            if meta.get("step") != step:
                raise Damaged(f"meta '{step}/meta/metadata' belongs to step {meta.get('step')}")
        if self.accept is not None:
            self.accept(step, meta)
        check_compatible(step, self.directory, meta, abstract_state, self.config)
        verify_array_files(step_dir / "state")
        self._check_array_metadata(step, meta)
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        regrouped = None
        if data_iter is not None:
            if "data_checksums" in meta:
                regrouped = self._data_state(step, meta["data_checksums"], data_iter)
            if regrouped is None:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        if not sealed or (data_iter is not None and "data_checksums" not in meta):
            print(
                f"lm: warning: checkpoint step {step} in '{self.directory}' predates the checksums of its meta "
                "and data items; restoring them unchecked (the state's arrays are checked)",
                flush=True,
            )
        state = self.manager.restore(step, args=ocp.args.Composite(**items))["state"]
        for path, want, got in zip(leaf_paths(state), meta["checksums"], checksums(state, meta.get("checksum_kind"))):
            if want != got:
                raise Damaged(f"state array '{path}' differs from what was saved (checksum {got} != {want})")
        if regrouped is not None:
            data_iter.set_state(regrouped)
        return state, meta

    def _data_state(self, step: int, saved: dict, data_iter) -> dict | None:
        """Checks every saved data state against its digest. grain keeps one iterator state per
        process: saved by as many processes as this run has, None (grain restores its own);
        otherwise this process's state, regrouped by batch row from all the saved ones."""
        step_dir, count = self.directory / str(step), jax.process_count()
        if set(saved) == {data_file(i, count) for i in range(count)}:
            verify_data(step_dir, saved)
            return None
        now = data_iter.get_state()
        try:
            if not isinstance(now, dict) or "rows" not in now:
                raise UserError("this stage's data iterator does not record which batch rows it feeds")
            verify_data(step_dir, saved)
            states = {name: json.loads((step_dir / "data" / name).read_text()) for name in saved}
            return regroup_state(states, now["rows"])
        except UserError as e:
            raise IncompatibleCheckpoint(
                f"checkpoint step {step} in '{self.directory}' holds the data position of {len(saved)} "
                f"process(es), this run has {count}, and it cannot be regrouped: {e}; resume with "
                f"{len(saved)} process(es) or start a new --workdir"
            ) from None

    def _check_array_metadata(self, step: int, meta: dict) -> None:
        """Orbax's own tree metadata must be there and agree: exports and other tools read it."""
        tree = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        tree = getattr(tree, "tree", tree)
        listed = {p: [list(m.shape), str(m.dtype)] for p, m in zip(leaf_paths(tree), jax.tree.leaves(tree))}
        if listed != meta["shapes"]:
            raise Damaged(f"state metadata '{step}/state/_METADATA' disagrees with the shapes recorded at save time")

    def _reject(self, step: int, reason: str, restored: int) -> None:
        """Moves a damaged step out of the manager's sight (kept for inspection) and says why.
        Every process checks every item, so all reject the same step; process 0 moves it once
        all of them are done reading it."""
        target = self.rejected_dir / str(step)
        print(
            f"lm: warning: checkpoint step {step} is damaged ({reason}); moved to '{target}', "
            f"resuming from step {restored}",
            flush=True,
        )
        _barrier(f"lm_checked_checkpoint_{step}")
        if jax.process_index() == 0:
            self.rejected_dir.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(self.directory / str(step)), str(target))
        _barrier(f"lm_reject_checkpoint_{step}")
        self.manager.reload()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
