"""Where the engine's arrays live: the page pool placed by its logical axes (kv heads over
`tensor`, the pool's rows replicated), request rows over the batch axes when they divide evenly."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.sharding import batch_sharding, logical_sharding, split_count


class Placement:
    """Puts host arrays on the mesh (or the default device) and brings results back."""

    def __init__(self, mesh=None, rules=()):
        self.mesh, self.rules = mesh, rules
        if mesh is not None:
            self.batch_axes = batch_sharding(mesh, rules).spec[0]
            self.shards = split_count(mesh, self.batch_axes)
        else:
            self.shards = 1

    def rows(self, n: int) -> int:
        """n rounded up to a multiple of the batch shards."""
        return -(-n // self.shards) * self.shards

    def put(self, x):
        x = np.asarray(x)
        if self.mesh is None:
            return jax.device_put(x)
        split = x.ndim and x.shape[0] % self.shards == 0
        spec = PartitionSpec(self.batch_axes) if split else PartitionSpec()
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    @staticmethod
    def host(tree):
        """Whole arrays on this host, in one transfer (with several processes, each holds only its
        shards: gathered)."""
        if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


@functools.lru_cache(maxsize=16)
def _abstract_pool(model):
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda rng: model.init(rng, ids, ids, ids, decode=True, page_table=ids)["cache"],
                          jax.random.PRNGKey(0))


def init_pool(model, place: Placement):
    """A zero pool for a paged model (`Transformer(paging=...)`), placed by its logical axes."""
    return _zeros(model, place.mesh, place.rules)()


@functools.lru_cache(maxsize=16)
def _zeros(model, mesh, rules):
    """The jitted zeros of one model's pool on one mesh (compiled once, however many engines)."""
    boxed = _abstract_pool(model)
    shapes = nn.unbox(boxed)
    shardings = None
    if mesh is not None:
        specs = nn.get_partition_spec(boxed)
        shardings = jax.tree.map(lambda spec: logical_sharding(mesh, rules, tuple(spec)), specs,
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), out_shardings=shardings)


def pool_bytes(pool) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
