"""TrainState and its creation directly in sharded form (eval_shape -> shardings -> jitted init)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from lm.model.transformer import init_params
from lm.sharding import param_shardings, replicated


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key: plain array for checkpointing


def state_shardings(model, optimizer, mesh, rules):
    """Shardings for every leaf of the TrainState, derived from the params' logical axes."""
    boxed = jax.eval_shape(lambda r: init_params(model, r), jax.random.PRNGKey(0))
    p_shard = param_shardings(boxed, mesh, rules)
    opt_abstract = jax.eval_shape(optimizer.init, nn.unbox(boxed))
    o_shard = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, p_shard,
                                    transform_non_params=lambda _: replicated(mesh))
    rep = replicated(mesh)
    return TrainState(step=rep, params=p_shard, opt_state=o_shard, rng=rep)


def _init_fn(model, optimizer):
    def init(rng):
        param_rng, state_rng = jax.random.split(rng)
        params = nn.unbox(init_params(model, param_rng))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=state_rng)

    return init


def create_state(model, optimizer, mesh, rules, seed: int):
    """Returns (state, shardings); params are created on their devices, never gathered on one."""
    shardings = state_shardings(model, optimizer, mesh, rules)
    state = jax.jit(_init_fn(model, optimizer), out_shardings=shardings)(jax.random.PRNGKey(seed))
    return state, shardings


def abstract_state(model, optimizer, shardings):
    """ShapeDtypeStructs carrying the target shardings: the restore target for checkpoints."""
    shapes = jax.eval_shape(_init_fn(model, optimizer), jax.random.PRNGKey(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
