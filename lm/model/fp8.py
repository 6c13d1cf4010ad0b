"""FP8 training products for the blocks' projections (`model.fp8`; docs/fp8.md).

Forward: the activation and each weight are rounded to float8_e4m3fn, each with its own
per-tensor *current* scale (amax of the tensor itself this step / 448, so its largest value
lands on e4m3's largest), multiplied with float32 accumulation, and the product is multiplied
by the two scales. Backward: the incoming gradient is rounded to float8_e5m2 (wider range, one
mantissa bit less) with its own current scale, and both gradient products take it against the
e4m3 operands saved by the forward pass: dx = g8 . w8 * (sg * sw), dw = x8 . g8 * (sx * sg).
A custom VJP makes these the only roundings: autodiff through the casts would give the operands
a zero gradient, and through dequantized copies it would compute the backward in high precision.

The fp8 values enter the dots as they are, so a backend with fp8 matrix units (H100/H200; TPUs
that have them) can run them there; XLA:CPU converts them to float32 first, which gives the same
numbers (a product of two fp8 values is exact in float32). The residuals kept for the backward
are the fp8 operands: one byte a value. Current scaling keeps no state: the params tree and the
train state are those of the plain model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, largest 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest 57344


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `dtype`, scale): scale = max |x| / dtype's largest, in float32; an all-zero
    tensor gets scale 1 (no 0 / 0). Both divisions are spelled as products with a float32
    reciprocal, as XLA would rewrite them anyway: the rounding is then the same on every backend
    and by hand. Values are clipped to the range before the cast: a quotient an ulp above it would
    otherwise become NaN (e4m3fn has no infinity)."""
    top = float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    scale = jnp.where(amax > 0, amax * jnp.float32(1 / top), 1.0).astype(jnp.float32)
    return jnp.clip(xf * (1 / scale), -top, top).astype(dtype), scale


def _parts(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    return x, w, out


def _dot(spec: str, a, b, scale) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale


@functools.lru_cache(maxsize=None)
def _matmuls_fn(specs: tuple[str, ...], x_dtype: str, w_dtypes: tuple[str, ...], out_dtype: str):
    parts = [_parts(s) for s in specs]

    def forward(x, ws):
        xq, sx = quantize(x, E4M3)  # once for all the products of x
        wqs = [quantize(w, E4M3) for w in ws]
        ys = tuple(_dot(s, xq, wq, sx * sw).astype(out_dtype) for s, (wq, sw) in zip(specs, wqs))
        return ys, (xq, sx, tuple(wqs))

    @jax.custom_vjp
    def matmuls(x, ws):
        return forward(x, ws)[0]

    def backward(saved, gs):
        xq, sx, wqs = saved
        dx, dws = None, []
        for (xl, wl, ol), (wq, sw), w_dtype, g in zip(parts, wqs, w_dtypes, gs):
            gq, sg = quantize(g, E5M2)
            term = _dot(f"{ol},{wl}->{xl}", gq, wq, sg * sw)
            dx = term if dx is None else dx + term
            dws.append(_dot(f"{xl},{ol}->{wl}", xq, gq, sx * sg).astype(w_dtype))
        return dx.astype(x_dtype), tuple(dws)

    matmuls.defvjp(forward, backward)
    return matmuls


def matmuls(x: jax.Array, specs, weights, out_dtype=None) -> tuple[jax.Array, ...]:
    """`jnp.einsum(spec, x, w)` for each (spec, w), as fp8 products (see the module's note), in
    `out_dtype` (default x's dtype). Gradients come back in x's and each weight's own dtype."""
    specs = tuple(s.replace(" ", "") for s in specs)
    fn = _matmuls_fn(
        specs,
        jnp.dtype(x.dtype).name,
        tuple(jnp.dtype(w.dtype).name for w in weights),
        jnp.dtype(out_dtype or x.dtype).name,
    )
    return fn(x, tuple(weights))


def matmul(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    return matmuls(x, [spec], [w], out_dtype)[0]
