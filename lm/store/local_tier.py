"""The local checkpoint tier: frequent saves of each process's own shards to a fast per-host disk
(checkpoint.local_dir), beside the rare, shared persistent checkpoints (lm.store.checkpoint).

After a preemption every host usually comes back with its local disk: restoring from it skips
reading the whole model from shared storage, and the local saves are frequent, so little work is
lost. A host that was replaced has no local files: the processes agree on the newest step that
EVERY process holds complete, and when there is none (or the persistent tier is newer) the run
restores from the persistent tier, which also restores onto another number of processes.

One step is `<local_dir>/<step>/process_I-of-N.bin` (every addressable shard of every state leaf,
replicas included, so a process needs no other's files) and `process_I-of-N.json` (the run's
identity, the layout it was written for: process count, mesh, shardings; each shard's offset,
dtype, index and CRC32; the data iterator's state; the loop's health; the metrics digest),
written last through a temporary name: a process's part of a step is complete iff its JSON is
there and every CRC matches. The arrays come off the devices before `save` returns (the step
donates the state); the writing runs in the background. The newest `keep` steps stay.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import shutil
import zlib

import jax
import numpy as np

from lm.model.params import leaf_paths


def _part() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}"


def _layout(state) -> list:
    """What restoring needs to be the same: every leaf's path, shape, dtype and sharding (its mesh
    with the devices in order, and its spec)."""
    return [
        [p, list(x.shape), str(x.dtype), _placement(x.sharding)]
        for p, x in zip(leaf_paths(state), jax.tree.leaves(state))
    ]


def _placement(sharding) -> str:
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return str(sharding)
    return f"{dict(mesh.shape)} {[d.id for d in mesh.devices.flat]} {sharding.spec}"


class LocalTier:
    """Saves and restores this process's shards under `directory` (see the module doc)."""

    def __init__(self, directory, every_steps: int, keep: int = 2, identity: dict | None = None):
        self.directory = pathlib.Path(directory).absolute()
        self.every_steps, self.keep, self.identity = every_steps, keep, identity
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._pending: concurrent.futures.Future | None = None

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    # ---- saving ----------------------------------------------------------------------------

    def save(self, step: int, state, data_state: dict, extra: dict) -> None:
        """Copies this process's shards to host memory now; writes them in the background."""
        self.wait()
        shards = []
        for n, leaf in enumerate(jax.tree.leaves(state)):
            for s in leaf.addressable_shards:
                shards.append((n, s.device.id, _index(s.index, leaf.shape), np.asarray(s.data)))
        meta = {
            "step": int(step),
            "identity": self.identity,
            "processes": jax.process_count(),
            "layout": _layout(state),
            "data": data_state,
        } | extra
        self._pending = self._writer.submit(self._write, step, shards, meta)

    def _write(self, step: int, shards: list, meta: dict) -> None:
        step_dir = self.directory / str(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        name = _part()
        entries, offset = [], 0
        tmp = step_dir / f"{name}.bin.tmp"
        with open(tmp, "wb") as f:
            for n, device, index, data in shards:
                raw = np.ascontiguousarray(data).tobytes()
                f.write(raw)
                entries.append([n, device, index, str(data.dtype), list(data.shape), offset, len(raw), zlib.crc32(raw)])
                offset += len(raw)
        tmp.replace(step_dir / f"{name}.bin")
        json_tmp = step_dir / f"{name}.json.tmp"
        json_tmp.write_text(json.dumps(meta | {"shards": entries}))
        json_tmp.replace(step_dir / f"{name}.json")  # last: the part is complete
        for old in self.complete_steps()[: -self.keep]:
            self._drop(old)

    def _drop(self, step: int) -> None:
        """Removes this process's part of an old step (and the step once empty)."""
        step_dir = self.directory / str(step)
        name = _part()
        for suffix in (".json", ".bin"):
            (step_dir / f"{name}{suffix}").unlink(missing_ok=True)
        if step_dir.exists() and not any(step_dir.iterdir()):
            shutil.rmtree(step_dir, ignore_errors=True)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()  # a failed write raises here
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()

    # ---- restoring -------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps whose part for this process has its JSON (oldest first; contents checked on restore)."""
        if not self.directory.is_dir():
            return []
        name = _part()
        steps = [int(d.name) for d in self.directory.iterdir() if d.name.isdigit() and (d / f"{name}.json").exists()]
        return sorted(steps)

    def agreed_step(self) -> int | None:
        """The newest step every process holds complete (None: some process holds none of them)."""
        mine = self.complete_steps()[-8:]
        if jax.process_count() == 1:
            return mine[-1] if mine else None
        from lm.sharding import to_host

        padded = np.full((1, 8), -1, np.int64)
        padded[0, : len(mine)] = mine
        everyone = np.asarray(to_host(padded)).reshape(jax.process_count(), 8)
        common = set.intersection(*(set(int(s) for s in row if s >= 0) for row in everyone))
        return max(common) if common else None

    def read(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(this process's shards by (leaf number, device id, index), meta) of `step`, checked; ValueError names
        what does not match or is damaged (the caller falls back to the persistent tier)."""
        step_dir = self.directory / str(step)
        name = _part()
        try:
            meta = json.loads((step_dir / f"{name}.json").read_text())
            raw = (step_dir / f"{name}.bin").read_bytes()
        except (OSError, ValueError) as e:
            raise ValueError(f"'{step_dir / name}' cannot be read ({e})") from None
        if meta.get("identity") != self.identity:
            raise ValueError("it was written by another run")
        if meta.get("processes") != jax.process_count() or meta.get("layout") != _layout(abstract_state):
            raise ValueError("it was written for another mesh or number of processes")
        shards: dict = {}
        for n, device, index, dtype, shape, offset, size, crc in meta["shards"]:
            chunk = raw[offset : offset + size]
            if len(chunk) != size or zlib.crc32(chunk) != crc:
                raise ValueError(f"'{step_dir / name}.bin' differs from what was saved")
            shards[(n, device, json.dumps(index))] = np.frombuffer(chunk, dtype=jax.numpy.dtype(dtype)).reshape(shape)
        return shards, meta

    @staticmethod
    def build(shards: dict, abstract_state):
        """The state on abstract_state's shardings from the shards `read` returned."""
        devices = {d.id: d for d in jax.local_devices()}

        def leaf(n, x):
            index_of = x.sharding.addressable_devices_indices_map(x.shape)
            parts = [
                jax.device_put(shards[(n, d.id, json.dumps(_index(idx, x.shape)))], devices[d.id])
                for d, idx in index_of.items()
            ]
            return jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts)

        leaves, tree = jax.tree.flatten(abstract_state)
        return jax.tree.unflatten(tree, [leaf(n, x) for n, x in enumerate(leaves)])


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process."""
    if jax.process_count() == 1:
        return flag
    from lm.sharding import to_host

    return bool(np.asarray(to_host(np.asarray([[int(flag)]], np.int32))).max())


def _index(index, shape) -> list:
    """A shard's index (a tuple of slices) as [[start, stop], ...] for JSON."""
    return [[s.start or 0, shape[i] if s.stop is None else s.stop] for i, s in enumerate(index)]
