"""Heads other than the LM head, on the trunk's final hidden states."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model.layers import Partitioning
from lm.model.params import param
from lm.model.spec import ModelSpec


class ScalarHead(nn.Module):
    """d_model -> one float32 value per position: a reward model's score or PPO's value.

    Starts at zero output (zero weights), so a head added to a trained trunk begins neutral.
    """

    spec: ModelSpec
    part: Partitioning = Partitioning()

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        w = param(self, "kernel", nn.initializers.zeros, (self.spec.d_model,), ("embed",))
        b = param(self, "bias", nn.initializers.zeros, (), ())
        # gathered whole (d_model floats): met by rows split over the same axis, the product would
        # otherwise move the rows by collective permutes, which a 1F1B stage's loss branch cannot run
        w = self.part.constrain(w, (None,))
        return jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), w) + b
