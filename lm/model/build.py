"""A model on a mesh: config and rule table -> mesh, spec, module and the params' shardings.

Everything that runs a model builds it here: training adds an optimizer on top (lm.train.setup),
sampling, scoring and evaluation use it as it is. Nothing here knows an optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.linen as nn
import jax
from jax.sharding import Mesh

from lm.model.apply import logits_of
from lm.model.layers import Partitioning
from lm.model.params import check_fits, subtree
from lm.model.qtensor import QTensor
from lm.model.quant import place_quantized_leaf
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, abstract_params
from lm.sharding import batch_sharding, batch_shardings, make_mesh, param_shardings, place_leaf, split_count


@dataclasses.dataclass(frozen=True)
class FrozenModel:
    """A model that does not train, as a loss sees it inside a step: its module and its params."""

    module: nn.Module
    params: dict

    def apply(self, batch: dict, output: str = "logits"):
        return logits_of(self.module, self.params, batch, output=output)


ModelFn = Callable[[ModelSpec, Partitioning], nn.Module]
reward_model: ModelFn = functools.partial(Transformer, scalar_head=True)  # a trunk with a scalar head


@dataclasses.dataclass(frozen=True)
class Built:
    """A module on a mesh: its spec, the rule table and where each param lives."""

    mesh: Mesh
    rules: tuple
    spec: ModelSpec
    module: nn.Module
    param_shardings: dict  # NamedShardings, shaped like the params

    def abstract_params(self) -> dict:
        """The params' shapes and dtypes (ShapeDtypeStructs, unboxed): nothing allocated."""
        return nn.unbox(abstract_params(self.module))

    def check(self, params: dict, source: str, complete: bool = False) -> None:
        """`params` (all or part of this model's; all if `complete`) must have its names and shapes."""
        check_fits(self.abstract_params(), params, source, complete)

    def place(self, params: dict, dtype=None) -> dict:
        """Host params (all or part of this model's; numpy or lazy leaves) on the mesh with their
        shardings, shard by shard; `dtype` narrows floating leaves (a frozen copy in the compute
        dtype), never widens them (lm.sharding.placed_dtype)."""

        def one(x, sh):
            return place_quantized_leaf(x, sh) if isinstance(x, QTensor) else place_leaf(x, sh, dtype)

        return jax.tree.map(
            one, params, subtree(self.param_shardings, params), is_leaf=lambda x: isinstance(x, QTensor)
        )

    def batch_shardings(self, signature: dict) -> dict:
        return batch_shardings(self.mesh, self.rules, signature)

    def batch_shards(self) -> int:
        """How many ways the batch axis is split on this mesh."""
        return split_count(self.mesh, batch_sharding(self.mesh, self.rules).spec[0])


def build_model(
    config,
    devices=None,
    *,
    rules: tuple,
    model_fn: ModelFn = Transformer,
    spec: ModelSpec | None = None,
    mesh: Mesh | None = None,
) -> Built:
    """The model of `config.model` on the mesh of `config.mesh` (over `devices`, default all),
    or on `mesh` when given (a frozen model beside a trained one shares its mesh), its activations
    and params placed by `rules` (the config's logical-axis rule table). model_fn: the module for a
    spec and its partitioning (default: the decoder); spec overrides config.model's."""
    mesh = mesh or make_mesh(config.mesh, devices)
    spec = spec or ModelSpec.from_config(config.model)
    module = model_fn(spec, Partitioning(mesh, rules))
    return Built(mesh, rules, spec, module, param_shardings(abstract_params(module), mesh, rules))
