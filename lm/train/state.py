"""TrainState and its creation directly in sharded form (eval_shape -> shardings -> jitted init).

A run may train only part of the model's params (LoRA adapters): `trainable(path)` picks them.
The state then holds only those (and the optimizer state only theirs); the rest are *frozen*
params: sharded like any param, passed to the step beside the state, never differentiated,
never in the optimizer and never in a checkpoint (they come from the run's --init).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from lm.errors import UserError
from lm.model.transformer import init_params
from lm.sharding import param_shardings, replicated


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key: plain array for checkpointing


def split_params(tree, trainable: Callable[[tuple], bool] | None) -> tuple[dict, dict | None]:
    """(trained, frozen) nested dicts by `trainable(path)`; frozen is None when trainable is None."""
    if trainable is None:
        return tree, None

    def pick(node, path, keep):
        out = {}
        for k, v in node.items():
            if isinstance(v, dict):
                sub = pick(v, path + (jax.tree_util.DictKey(k),), keep)
                if sub:
                    out[k] = sub
            elif bool(trainable(path + (jax.tree_util.DictKey(k),))) == keep:
                out[k] = v
        return out

    return pick(tree, (), True), pick(tree, (), False)


def merge_trees(a: dict, b: dict | None) -> dict:
    """The union of two nested dicts with disjoint leaves (trained + frozen -> all params)."""
    if b is None:
        return a
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_trees(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def state_shardings(model, optimizer, mesh, rules, trainable=None):
    """(TrainState shardings, frozen params' shardings or None), from the params' logical axes."""
    boxed = jax.eval_shape(lambda r: init_params(model, r), jax.random.PRNGKey(0))
    p_shard, f_shard = split_params(param_shardings(boxed, mesh, rules), trainable)
    opt_abstract = jax.eval_shape(optimizer.init, split_params(nn.unbox(boxed), trainable)[0])
    o_shard = optax.tree_map_params(optimizer, lambda _, s: s, opt_abstract, p_shard,
                                    transform_non_params=lambda _: replicated(mesh))
    rep = replicated(mesh)
    return TrainState(step=rep, params=p_shard, opt_state=o_shard, rng=rep), f_shard


def _with_base(params: dict, base: dict | None) -> dict:
    """params with every leaf that `base` holds replaced by base's (same shapes, checked before)."""
    if base is None:
        return params
    return {k: (_with_base(v, base.get(k)) if isinstance(v, dict) else base.get(k, v).astype(v.dtype))
            for k, v in params.items()}


def check_base(model, base: dict, source: str) -> None:
    """base must hold only params of the model, with the model's shapes: one line naming the first misfits."""
    from lm.train.checkpoint import leaf_paths  # lazy: orbax

    want = nn.unbox(jax.eval_shape(lambda r: init_params(model, r), jax.random.PRNGKey(0)))
    want = dict(zip(leaf_paths(want), [x.shape for x in jax.tree.leaves(want)]))
    got = dict(zip(leaf_paths(base), [tuple(x.shape) for x in jax.tree.leaves(base)]))
    bad = [f"{p}: {s} (model has {want[p]})" for p, s in got.items() if p in want and tuple(want[p]) != s]
    bad += [f"{p}: not a param of this model" for p in got if p not in want]
    if bad:
        raise UserError(f"{source} does not fit the model: " + "; ".join(bad[:5]) +
                        (f"; ... ({len(bad)} in all)" if len(bad) > 5 else ""))


def _init_fn(model, optimizer, trainable=None):
    def init(rng, base=None):
        param_rng, state_rng = jax.random.split(rng)
        params, frozen = split_params(_with_base(nn.unbox(init_params(model, param_rng)), base), trainable)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=state_rng), frozen

    return init


def create_state(model, optimizer, mesh, rules, seed: int, trainable=None, base: dict | None = None):
    """Returns (state, frozen, shardings); params are created on their devices, never gathered on
    one. base: params (e.g. a pretrained model's) that replace the fresh ones where present."""
    shardings, f_shard = state_shardings(model, optimizer, mesh, rules, trainable)
    init = _init_fn(model, optimizer, trainable)
    if base is None:
        state, frozen = jax.jit(init, out_shardings=(shardings, f_shard))(jax.random.PRNGKey(seed))
    else:
        all_shard = merge_trees(shardings.params, f_shard)
        base_shard = jax.tree.map(lambda _, sh: sh, base, _subtree(all_shard, base))
        state, frozen = jax.jit(init, in_shardings=(replicated(mesh), base_shard),
                                out_shardings=(shardings, f_shard))(jax.random.PRNGKey(seed), base)
    return state, frozen, shardings


def _subtree(tree: dict, like: dict) -> dict:
    return {k: _subtree(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def abstract_state(model, optimizer, shardings, trainable=None):
    """ShapeDtypeStructs carrying the target shardings: the restore target for checkpoints."""
    shapes = jax.eval_shape(_init_fn(model, optimizer, trainable), jax.random.PRNGKey(0))[0]
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
