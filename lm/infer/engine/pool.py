"""Where the engine's arrays live: the page pool placed by its logical axes (kv heads over
`tensor`, the pool's rows replicated), request rows over the batch axes when they divide evenly."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.sharding import batch_sharding, logical_sharding, split_count, to_host


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

    def sharding(self, shape) -> NamedSharding | None:
        """Where `put` places an array of `shape`: rows over the batch axes when they divide evenly,
        else replicated (None: the default device)."""
        if self.mesh is None:
            return None
        split = len(shape) and shape[0] % self.shards == 0
        return NamedSharding(self.mesh, PartitionSpec(self.batch_axes) if split else PartitionSpec())

    def put(self, x):
        x = np.asarray(x)
        if self.mesh is None:
            return jax.device_put(x)
        return jax.device_put(x, self.sharding(x.shape))

    def abstract(self, x) -> jax.ShapeDtypeStruct:
        """What `put(x)` makes, without making it (for compiling ahead of time)."""
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding(x.shape))

    @staticmethod
    def host(tree):
        """Whole arrays on this host, in one transfer (with several processes: gathered)."""
        return to_host(tree)


@functools.lru_cache(maxsize=16)
def _abstract_pool(model):
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda rng: model.init(rng, ids, ids, ids, decode=True, page_table=ids)["cache"], jax.random.PRNGKey(0)
    )


def init_pool(model, place: Placement):
    """A zero pool for a paged model (`Transformer(paging=...)`), placed by its logical axes."""
    return _zeros(model, place.mesh, place.rules)()


def abstract_pool(model, place: Placement):
    """What `init_pool` makes, as ShapeDtypeStructs with their shardings (for compiling ahead of time)."""
    shapes, shardings = nn.unbox(_abstract_pool(model)), _pool_shardings(model, place.mesh, place.rules)
    if shardings is None:
        return shapes
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings)


def _pool_shardings(model, mesh, rules):
    if mesh is None:
        return None
    specs = nn.get_partition_spec(_abstract_pool(model))
    return jax.tree.map(
        lambda spec: logical_sharding(mesh, rules, tuple(spec)), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


@functools.lru_cache(maxsize=16)
def _zeros(model, mesh, rules):
    """The jitted zeros of one model's pool on one mesh (compiled once, however many engines)."""
    shapes = nn.unbox(_abstract_pool(model))
    return jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
        out_shardings=_pool_shardings(model, mesh, rules),
    )


def pool_bytes(pool) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))


@functools.lru_cache(maxsize=16)
def page_copier(model):
    """A jitted (pool, src [n], dst [n]) -> pool with the token rows of page dst[i] set to those of
    page src[i] in every layer, all read before any is written (a dst past the pool: nothing).
    The pool is donated; its sharding follows the input's, like the engine's steps."""
    page = model.paging.page_size
    specs = nn.get_partition_spec(_abstract_pool(model))
    axes = jax.tree.map(
        lambda spec: tuple(spec).index("cache_pool"), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )

    def copy(pool, src, dst):
        rows = lambda pages: (pages[:, None] * page + jnp.arange(page)[None]).reshape(-1)  # noqa: E731

        def one(x, axis):
            at = (slice(None),) * axis
            return x.at[(*at, rows(dst))].set(jnp.take(x, rows(src), axis=axis), mode="drop")

        return jax.tree.map(one, pool, axes)

    return jax.jit(copy, donate_argnums=0)
