"""The KV cache: creation, shardings, and one prefill / decode step.

The cache is the decoder's "cache" collection: per layer (stacked on a leading `layers` axis,
like the params) keys and values [batch, kv_heads, max_len, head_dim] in the compute dtype,
and the segment id held by each slot [batch, max_len]. A token's slot is its position, per
row, so a batch of prompts of different lengths needs no left padding: prompts are
right-padded with segment id 0, and padding writes nothing.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.sharding import logical_sharding


@functools.lru_cache(maxsize=64)
def _abstract_cache(model, batch_size: int, max_len: int):
    """Boxed ShapeDtypeStructs of the cache (nothing is computed or allocated; traced once per shape)."""
    ids = jnp.zeros((batch_size, max_len), jnp.int32)

    def init(rng):
        return model.init(rng, ids, ids, ids, decode=True)["cache"]

    return jax.eval_shape(init, jax.random.PRNGKey(0))


def abstract_cache(model, batch_size: int, max_len: int, shardings=None):
    """The cache's ShapeDtypeStructs (unboxed), carrying `shardings` when given: an AOT input."""
    shapes = nn.unbox(_abstract_cache(model, batch_size, max_len))
    if shardings is None:
        return shapes
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings)


def init_cache(model, batch_size: int, max_len: int, shardings=None):
    """A zero cache for `batch_size` rows of up to `max_len` positions (placed with `shardings`)."""
    leaves, tree = jax.tree.flatten(shardings)
    return _zeros_fn(model, batch_size, max_len, tree, tuple(leaves))()


@functools.lru_cache(maxsize=64)
def _zeros_fn(model, batch_size: int, max_len: int, tree, leaves):
    abstract = nn.unbox(_abstract_cache(model, batch_size, max_len))
    shardings = None if not leaves else jax.tree.unflatten(tree, leaves)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)


def cache_shardings(model, batch_size: int, max_len: int, mesh, rules):
    """NamedShardings of the cache from its logical axes (batch, kv_heads, ... ) and the rule table."""
    specs = nn.get_partition_spec(_abstract_cache(model, batch_size, max_len))
    return jax.tree.map(
        lambda spec: logical_sharding(mesh, rules, tuple(spec)),
        specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


def decode_step(model, params, cache, inputs, segment_ids, positions, logits_at=None):
    """Prefill (t = prompt length) or decode (t = 1 or a few) -> (float32 logits [B, t, V], new cache).

    logits_at [B]: return only the logits at that index of each row ([B, 1, V]).

    Each token's key and value go to its slot (= position, per row; padding, segment 0, goes
    nowhere); each query sees the slots at or before its position that hold its segment.
    """
    logits, updated = model.apply(
        {"params": params, "cache": cache},
        inputs,
        segment_ids,
        positions,
        decode=True,
        logits_at=logits_at,
        mutable=["cache"],
    )
    return logits, updated["cache"]
