"""Params as plain nested dicts: declaring them, naming their leaves, splitting and merging trees,
and checking a given tree against a model's."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.errors import UserError
from lm.model.qtensor import QTensor


def param(module: nn.Module, name: str, init, shape, names, quantized: bool = False) -> jax.Array | QTensor:
    """A float32 param annotated with logical axis names. A quantized one (a `QTensor` in the
    given params) comes back as it is stored when the caller multiplies with it through
    `lm.model.qdot` (`quantized=True`), else dequantized to the module's compute dtype."""
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if isinstance(stored, QTensor):
            if stored.shape != tuple(shape):
                raise UserError(f"quantized param {name}: shape {stored.shape}, the model expects {tuple(shape)}")
            return stored if quantized else stored.dequantize(module.spec.dtype)
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree) -> list[str]:
    """'blocks/attn/wq'-style names of a tree's leaves, in leaf order."""
    return ["/".join(key_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


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


def subtree(tree: dict, like: dict) -> dict:
    """The part of `tree` with the keys of `like`."""
    return {k: subtree(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def check_fits(abstract: dict, given: dict, source: str, complete: bool = False) -> None:
    """`given` must hold only leaves of `abstract` (a model's params, shapes only), with their
    shapes (and, if `complete`, all of them): one line naming the first misfits."""
    want, got = _shapes(abstract), _shapes(given)
    bad = [f"{p}: {s} (model has {want[p]})" for p, s in got.items() if p in want and want[p] != s]
    bad += [f"{p}: not a param of this model" for p in got if p not in want]
    bad += [f"{p}: missing" for p in want if p not in got] if complete else []
    if bad:
        raise UserError(
            f"{source} does not fit the model: "
            + "; ".join(bad[:5])
            + (f"; ... ({len(bad)} in all)" if len(bad) > 5 else "")
        )


def _shapes(tree) -> dict:
    """{'blocks/attn/wq': shape} of a tree's leaves; a quantized weight counts as one leaf of its float shape."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QTensor))[0]
    return {"/".join(key_name(k) for k in path): tuple(x.shape) for path, x in flat}
