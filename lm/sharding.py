"""The device mesh (data, stage, fsdp, expert, context, tensor) and logical-axis -> mesh-axis shardings.

The rule table lives in the config (`mesh.rules`, defaults in `lm.config.DEFAULT_RULES`)
and is passed explicitly everywhere; nothing is read from a global context.
"""

from __future__ import annotations

import gc
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.config.mesh import AXES
from lm.errors import UserError

SIMULATE_HINT = "On a CPU, simulate N devices with XLA_FLAGS=--xla_force_host_platform_device_count=N"
BATCH_AXES = ("batch", "length")


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    """Resolves -1 to whatever devices are left; errors name the config keys."""
    sizes = [mesh_cfg.get(a, 1) for a in AXES]  # a plain dict may leave out the axes of size 1
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise UserError(
                f"mesh {dict(zip(AXES, sizes))}: the fixed axes ({known}) do not divide "
                f"the {n_devices} devices; {SIMULATE_HINT}"
            )
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise UserError(
            f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
            f"{n_devices} are available; set mesh.{'/'.join(AXES)} to multiply to {n_devices} "
            f"(one may be -1). {SIMULATE_HINT}"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def logical_sharding(mesh: Mesh, rules, names) -> NamedSharding:
    return NamedSharding(mesh, nn.logical_to_mesh_axes(names, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def field_sharding(mesh: Mesh, rules, ndim: int) -> NamedSharding:
    """A batch field of rank `ndim`: rows over the batch axes; a [B, T] text field's second
    axis follows the `length` rule; any further axes are replicated."""
    names = ("batch", "length") if ndim == 2 else ("batch",) + (None,) * (ndim - 1)
    return logical_sharding(mesh, rules, names)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """[B, T] text arrays: rows split over the batch axes (data, fsdp by default)."""
    return field_sharding(mesh, rules, 2)


def batch_shardings(mesh: Mesh, rules, signature: dict) -> dict:
    """One sharding per batch field, from its rank; `signature` maps names to arrays or shapes."""
    return {k: field_sharding(mesh, rules, len(getattr(v, "shape", v))) for k, v in signature.items()}


def param_shardings(boxed_abstract_params, mesh: Mesh, rules):
    """NamedShardings from the params' logical annotations, checking that every split divides."""
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_abstract_params), mesh, rules)

    def check(path, leaf, sharding):
        for dim, axes in zip(leaf.shape, sharding.spec):
            size = split_count(mesh, axes)
            if dim % size:
                raise UserError(
                    f"param {jax.tree_util.keystr(path)} {leaf.shape}: dimension {dim} is "
                    f"split over mesh axes {axes} of size {size}, which does not divide it; "
                    "change the model shape, the mesh, or mesh.rules"
                )

    jax.tree_util.tree_map_with_path(check, nn.unbox(boxed_abstract_params), shardings)
    return shardings


def placed_dtype(source, dtype=None) -> np.dtype:
    """The dtype a leaf is placed in: `dtype` for floating leaves, but never wider than the
    source (a frozen bf16 checkpoint stays bf16 in a float32 run)."""
    source = np.dtype(source)
    if dtype is None or not jnp.issubdtype(source, jnp.floating):
        return source
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize <= source.itemsize else source


BIG_LEAF = 64 * 2**20  # bytes


def place_leaf(x, sharding: NamedSharding, dtype=None) -> jax.Array:
    """A host leaf (numpy, or a lazy leaf that reads only the index it is given) as a global array
    with `sharding`: each local device's shard is read and put on its own, so the whole array is
    never gathered on the host (multi-host: each process reads only its devices' shards)."""
    target = placed_dtype(x.dtype, dtype)
    if isinstance(x, jax.Array) and x.sharding == sharding and x.dtype == target:
        return x
    out = jax.make_array_from_callback(
        tuple(x.shape), sharding, lambda index: np.asarray(x[index]).astype(target, copy=False)
    )
    if out.nbytes >= BIG_LEAF:  # jax lets go of the host pieces it copied at the next collection
        out.block_until_ready()
        gc.collect()
    return out


def split_count(mesh: Mesh, axes) -> int:
    """How many ways one array dimension is split by a PartitionSpec entry (None, name or tuple)."""
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    return math.prod(mesh.shape[a] for a in axes)


def to_host(tree):
    """The arrays of `tree` as whole numpy arrays on this host, in one transfer. With several
    processes a jax array is gathered from the shards every process holds, and a host (numpy)
    array is this process's part: the parts of all processes are concatenated along its first
    axis (process_allgather(tiled=True); give a part a leading axis of 1 to stack them)."""
    leaves = jax.tree.leaves(tree)
    if jax.process_count() == 1 or all(isinstance(x, jax.Array) and x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def per_device_bytes(tree) -> int:
    """Bytes of `tree` held on the first device (shows how sharding shrinks memory)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def process_rows(sharding: NamedSharding, global_rows: int, process: int | None = None) -> np.ndarray:
    """The global batch rows that `process` (default: this one) must feed, sorted.

    A process feeds the rows of every batch shard its devices hold (whole rows, even where `context`
    splits their tokens). When a non-batch mesh axis (e.g. `tensor`, `context`) spans processes,
    several processes hold the same shard and so feed the same rows: deriving rows from the
    devices, not from the process index, keeps them identical.
    """
    process = jax.process_index() if process is None else process
    by_rows = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))  # a [B, T] field's T may be split too
    rows = set()
    for device, index in by_rows.devices_indices_map((global_rows,)).items():
        if device.process_index == process:
            rows.update(range(*index[0].indices(global_rows)))
    return np.asarray(sorted(rows), np.int64)


class BatchPlacer:
    """Host rows -> global arrays, one sharding per field (any rank, batch axis first).

    `rows` are the global rows this process feeds (`process_rows`); a host batch holds them in
    that order. Each device's shard is cut from them by its global row range.
    """

    def __init__(self, shardings: dict, global_rows: int):
        self.shardings, self.global_rows = shardings, global_rows
        first = next(iter(shardings.values()))
        self.rows = process_rows(first, global_rows)
        for name, sh in shardings.items():
            if not np.array_equal(process_rows(sh, global_rows), self.rows):
                raise ValueError(f"batch field '{name}' is split over other mesh axes than the batch")
        self._local = {int(r): i for i, r in enumerate(self.rows)}

    def __call__(self, host_batch: dict) -> dict:
        """host_batch: this process's rows (len(self.rows) of them) of every field."""
        return {k: self._put(k, np.asarray(v)) for k, v in host_batch.items()}

    def from_global(self, batch: dict) -> dict:
        """A batch that every process holds whole (e.g. fixed held-out rows)."""
        return self({k: np.asarray(v)[self.rows] for k, v in batch.items()})

    def _put(self, name: str, x: np.ndarray) -> jax.Array:
        if x.shape[0] != len(self.rows):
            raise ValueError(f"batch field '{name}' has {x.shape[0]} rows; this process feeds {len(self.rows)}")

        def shard(index):
            start, stop, _ = index[0].indices(self.global_rows)
            first = self._local[start]  # a shard's rows are consecutive, and so are they locally
            return x[(slice(first, first + stop - start), *index[1:])]

        return jax.make_array_from_callback((self.global_rows, *x.shape[1:]), self.shardings[name], shard)
