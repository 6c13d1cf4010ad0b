"""TrainState and its creation directly in sharded form (eval_shape -> shardings -> jitted init).

A run may train only part of the model's params (LoRA adapters): `trainable(path)` picks them.
The state then holds only those (and the optimizer state only theirs); the rest are *frozen*
params: sharded like any param, passed to the step beside the state, never differentiated,
never in the optimizer and never in a checkpoint (they come from the run's --init).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from lm.model.params import check_fits, merge_trees, split_params, subtree
from lm.model.transformer import abstract_params, init_params
from lm.sharding import param_shardings, place_leaf, replicated


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key: plain array for checkpointing


def state_shardings(model, optimizer, mesh, rules, trainable=None):
    """(TrainState shardings, frozen params' shardings or None), from the params' logical axes."""
    boxed = abstract_params(model)
    p_shard, f_shard = split_params(param_shardings(boxed, mesh, rules), trainable)
    opt_abstract = jax.eval_shape(optimizer.init, split_params(nn.unbox(boxed), trainable)[0])
    # a partitioned optimizer (Muon + AdamW) holds MaskedNode where a branch keeps no state
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    o_shard = optax.tree_map_params(
        optimizer,
        lambda leaf, s: leaf if masked(leaf) else s,
        opt_abstract,
        p_shard,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=masked,
    )
    rep = replicated(mesh)
    return TrainState(step=rep, params=p_shard, opt_state=o_shard, rng=rep), f_shard


def _with_base(params: dict | None, base: dict | None, cast: bool) -> dict | None:
    """params with every leaf that `base` holds replaced by base's (same shapes, checked before):
    in the params' dtype if `cast` (trained: float32), else in base's (frozen: a bf16 checkpoint
    stays bf16)."""
    if base is None or params is None:
        return params
    return {
        k: (
            _with_base(v, base.get(k), cast)
            if isinstance(v, dict)
            else base[k].astype(v.dtype)
            if cast and k in base
            else base.get(k, v)
        )
        for k, v in params.items()
    }


def check_base(model, base: dict, source: str) -> None:
    """base must hold only params of the model, with the model's shapes."""
    check_fits(nn.unbox(abstract_params(model)), base, source)


def _init_fn(model, optimizer, trainable=None, param_dtype: str = "float32"):
    def init(rng, base=None):
        param_rng, state_rng = jax.random.split(rng)
        params, frozen = split_params(nn.unbox(init_params(model, param_rng)), trainable)
        params, frozen = _with_base(params, base, cast=True), _with_base(frozen, base, cast=False)
        params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=state_rng
        ), frozen

    return init


def create_state(
    model,
    optimizer,
    mesh,
    rules,
    seed: int,
    trainable=None,
    base: dict | None = None,
    frozen_out: bool = True,
    param_dtype: str = "float32",
):
    """Returns (state, frozen, shardings); params are created on their devices, never gathered on
    one. base: params (e.g. a pretrained model's) that replace the fresh ones where present.
    frozen_out=False: no frozen params (None), never made (a caller that holds the frozen base in
    another form, e.g. 4-bit, would otherwise hold a float copy of it for a moment). param_dtype:
    the trained params' dtype (train.param_dtype)."""
    shardings, f_shard = state_shardings(model, optimizer, mesh, rules, trainable)
    init = _init_fn(model, optimizer, trainable, param_dtype)
    outs = (shardings, f_shard)
    if not frozen_out:  # what is not returned is never computed
        init, outs = (lambda *args, _init=init: (_init(*args)[0], None)), (shardings, None)
    if base is None:
        state, frozen = jax.jit(init, out_shardings=outs)(jax.random.PRNGKey(seed))
    else:
        all_shard = merge_trees(shardings.params, f_shard)
        base_shard = jax.tree.map(lambda _, sh: sh, base, subtree(all_shard, base))
        base = jax.tree.map(place_leaf, base, base_shard)  # shard by shard: no whole host copy
        state, frozen = jax.jit(init, in_shardings=(replicated(mesh), base_shard), out_shardings=outs)(
            jax.random.PRNGKey(seed), base
        )
    return state, frozen, shardings


def abstract_state(model, optimizer, shardings, trainable=None, param_dtype: str = "float32"):
    """ShapeDtypeStructs carrying the target shardings: the restore target for checkpoints."""
    shapes = jax.eval_shape(_init_fn(model, optimizer, trainable, param_dtype), jax.random.PRNGKey(0))[0]
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
