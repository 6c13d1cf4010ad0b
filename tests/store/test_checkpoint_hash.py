"""State checksums: an order-sensitive hash of each leaf's bits, the same however the leaf is sharded."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.store.checkpoint_checks import checksums


def test_swapped_or_moved_elements_change_the_hash_but_not_the_wrapping_sum():
    x = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
    swapped = x.copy()
    swapped[1, 2], swapped[4, 5] = x[4, 5], x[1, 2]
    rolled = np.roll(x, 1, axis=1)
    hashes = [checksums({"w": a})[0] for a in (x, swapped, rolled, x.T.copy())]
    assert len(set(hashes)) == 4 and all(0 <= h < 2**64 for h in hashes)
    sums = [checksums({"w": a}, None)[0] for a in (x, swapped, rolled)]
    assert len(set(sums)) == 1  # why the old checksum was replaced
    one_bit = x.copy()
    one_bit.view(np.uint32)[3, 3] ^= 1
    assert checksums({"w": one_bit}) != checksums({"w": x})


def test_the_hash_is_the_same_on_any_sharding_and_for_every_dtype():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("a", "b"))
    rng = np.random.default_rng(1)
    tree = {
        "f32": rng.normal(size=(8, 16)).astype(np.float32),
        "bf16": rng.normal(size=(8, 16)).astype(jax.numpy.bfloat16),
        "i32": rng.integers(0, 1000, size=(4, 8)).astype(np.int32),
        "u8": np.arange(16, dtype=np.uint8),
        "scalar": np.int32(7),
    }
    want = checksums(tree)
    for spec in (PartitionSpec("a", "b"), PartitionSpec("b", None), PartitionSpec(None, "a")):
        placed = {
            k: jax.device_put(v, NamedSharding(mesh, spec if np.ndim(v) == 2 else PartitionSpec()))
            for k, v in tree.items()
        }
        assert checksums(placed) == want
