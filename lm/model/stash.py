"""Residuals kept for the backward pass, in a form the layer scan stacks cheaply.

XLA:CPU's float normalisation does not treat bfloat16 dynamic slices as supported, so a
bfloat16 residual stacked by the layer scan is upcast to float32 as a whole (twice the
bytes, plus a conversion pass over every layer's copy). Held as uint16 bits, the same
residual is stacked and sliced as plain data. The bitcasts are free on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stash(x: jax.Array) -> jax.Array:
    """x as a residual: 16-bit floats become their uint16 bits, everything else is unchanged."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def unstash(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `stash` for a value whose original dtype was `dtype`."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
