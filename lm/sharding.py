"""The device mesh (data, fsdp, tensor) and logical-axis -> mesh-axis shardings.

The rule table lives in the config (`mesh.rules`, defaults in `lm.config.DEFAULT_RULES`)
and is passed explicitly everywhere; nothing is read from a global context.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.errors import UserError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("batch", "length")


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, int, int]:
    """Resolves -1 to whatever devices are left; errors name the config keys."""
    sizes = [mesh_cfg[a] for a in AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise UserError(f"mesh {dict(zip(AXES, sizes))}: the fixed axes ({known}) do not divide "
                            f"the {n_devices} devices")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise UserError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
                        f"{n_devices} are available; set mesh.data/fsdp/tensor (one may be -1)")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def logical_sharding(mesh: Mesh, rules, names) -> NamedSharding:
    return NamedSharding(mesh, nn.logical_to_mesh_axes(names, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """[B, T] text arrays: rows split over the batch axes (data, fsdp by default)."""
    return logical_sharding(mesh, rules, BATCH_AXES)


def param_shardings(boxed_abstract_params, mesh: Mesh, rules):
    """NamedShardings from the params' logical annotations, checking that every split divides."""
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_abstract_params), mesh, rules)

    def check(path, leaf, sharding):
        for dim, axes in zip(leaf.shape, sharding.spec):
            size = split_count(mesh, axes)
            if dim % size:
                raise UserError(f"param {jax.tree_util.keystr(path)} {leaf.shape}: dimension {dim} is "
                                f"split over mesh axes {axes} of size {size}, which does not divide it; "
                                "change the model shape, the mesh, or mesh.rules")

    jax.tree_util.tree_map_with_path(check, nn.unbox(boxed_abstract_params), shardings)
    return shardings


def split_count(mesh: Mesh, axes) -> int:
    """How many ways one array dimension is split by a PartitionSpec entry (None, name or tuple)."""
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    return math.prod(mesh.shape[a] for a in axes)


def per_device_bytes(tree) -> int:
    """Bytes of `tree` held on the first device (shows how sharding shrinks memory)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def host_batch_to_global(batch: dict, sharding: NamedSharding) -> dict:
    """Each process passes its local rows; the result is one global array per field."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
