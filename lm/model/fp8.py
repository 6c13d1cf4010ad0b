"""FP8 training products for the blocks' projections (`model.fp8`; docs/fp8.md).

Forward: the activation and each weight are rounded to float8_e4m3fn, each with its own
per-tensor scale, multiplied with float32 accumulation, and the product is multiplied by the two
scales. Backward: the incoming gradient is rounded to float8_e5m2 (wider range, one mantissa bit
less) with its own scale, and both gradient products take it against the e4m3 operands saved by
the forward pass: dx = g8 . w8 * (sg * sw), dw = x8 . g8 * (sx * sg). A custom VJP makes these
the only roundings: autodiff through the casts would give the operands a zero gradient, and
through dequantized copies it would compute the backward in high precision.

A scale is amax / (the format's largest). *Current* scaling takes the amax of the tensor itself
this step. *Delayed* scaling (`model.fp8_scaling=delayed`, Transformer Engine's recipe) takes
the largest amax of the last `model.fp8_history` steps, so the scale is known before the tensor
is: each product site keeps an amax history param `fp8_<site>/amax_history` [history, 1 + 2n]
(columns: x, the n weights, the n gradients; newest step first). The product records this
step's amaxes as the history's "gradient" (row 0; the rest zero) and the update routine shifts
them in (`lm.train.steps`), so the histories live in the params tree: checkpointed, sharded and
resumed with them. A history that is still all zero (the first step) falls back to current
scaling; a value above a delayed scale's range saturates at the format's largest.

The fp8 values enter the dots as they are, so a backend with fp8 matrix units (H100/H200; TPUs
that have them) can run them there; XLA:CPU converts them to float32 first, which gives the same
numbers (a product of two fp8 values is exact in float32). The residuals kept for the backward
are the fp8 operands: one byte a value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, largest 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest 57344
HISTORY_PREFIX = "fp8_"  # the name of every amax history param starts with it


def history_columns(n_weights: int) -> int:
    """A site's history columns: its activation, its n weights and their n gradients."""
    return 1 + 2 * n_weights


def is_history(path) -> bool:
    """Whether a params-tree path (of DictKeys, any prefix: an optimizer state's too) leads to an
    amax history (`.../fp8_<site>/amax_history`)."""
    return len(path) >= 2 and str(getattr(path[-2], "key", path[-2])).startswith(HISTORY_PREFIX)


def without_histories(tree: dict) -> dict:
    """A params tree without its amax histories (scaling state, not weights: nothing to export)."""
    return {
        k: without_histories(v) if isinstance(v, dict) else v
        for k, v in tree.items()
        if not str(k).startswith(HISTORY_PREFIX)
    }


def shift_history(history: jax.Array, recorded: jax.Array) -> jax.Array:
    """The history after one step: `recorded`'s row 0 (this step's amaxes) in front, the
    oldest row dropped. Works on a stack of histories (scanned layers) along axis -2."""
    return jnp.concatenate([recorded[..., :1, :], history[..., :-1, :]], axis=-2)


def quantize(x: jax.Array, dtype, past: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x / scale in `dtype`, scale, amax of x): scale = a / dtype's largest, where a is `past`
    (a delayed amax) when given and positive, else x's own amax; an all-zero tensor gets scale 1
    (no 0 / 0). Both divisions are spelled as products with a float32 reciprocal, as XLA would
    rewrite them anyway: the rounding is then the same on every backend and by hand. Values are
    clipped to the range before the cast: above it they saturate (e4m3fn has no infinity)."""
    top = float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    a = amax if past is None else jnp.where(past > 0, past, amax)
    scale = jnp.where(a > 0, a * jnp.float32(1 / top), 1.0).astype(jnp.float32)
    return jnp.clip(xf * (1 / scale), -top, top).astype(dtype), scale, amax


def _parts(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    return x, w, out


def _dot(spec: str, a, b, scale) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale


@functools.lru_cache(maxsize=None)
def _matmuls_fn(specs: tuple[str, ...], x_dtype: str, w_dtypes: tuple[str, ...], out_dtype: str):
    parts, n = [_parts(s) for s in specs], len(specs)

    def forward(x, ws, history):
        past = None if history is None else jnp.max(history, axis=0)  # per column, over the steps kept
        col = lambda i: None if past is None else past[i]  # noqa: E731
        xq, sx, ax = quantize(x, E4M3, col(0))  # once for all the products of x
        wqs = [quantize(w, E4M3, col(1 + i)) for i, w in enumerate(ws)]
        ys = tuple(_dot(s, xq, wq, sx * sw).astype(out_dtype) for s, (wq, sw, _) in zip(specs, wqs))
        seen = None if history is None else jnp.stack([ax] + [a for _, _, a in wqs])
        return ys, (xq, sx, tuple((wq, sw) for wq, sw, _ in wqs), past, seen, history)

    @jax.custom_vjp
    def matmuls(x, ws, history):
        return forward(x, ws, history)[0]

    def backward(saved, gs):
        xq, sx, wqs, past, seen, history = saved
        dx, dws, ags = None, [], []
        for i, ((xl, wl, ol), (wq, sw), w_dtype, g) in enumerate(zip(parts, wqs, w_dtypes, gs)):
            gq, sg, ag = quantize(g, E5M2, None if past is None else past[1 + n + i])
            ags.append(ag)
            term = _dot(f"{ol},{wl}->{xl}", gq, wq, sg * sw)
            dx = term if dx is None else dx + term
            dws.append(_dot(f"{xl},{ol}->{wl}", xq, gq, sx * sg).astype(w_dtype))
        recorded = None
        if history is not None:  # this step's amaxes as the history's "gradient" (lm.train.steps shifts them in)
            recorded = jnp.zeros_like(history).at[0].set(jnp.concatenate([seen, jnp.stack(ags)]))
        return dx.astype(x_dtype), tuple(dws), recorded

    matmuls.defvjp(forward, backward)
    return matmuls


def matmuls(x: jax.Array, specs, weights, out_dtype=None, history: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """`jnp.einsum(spec, x, w)` for each (spec, w), as fp8 products (see the module's note), in
    `out_dtype` (default x's dtype). Gradients come back in x's and each weight's own dtype.
    `history`: the site's amax history for delayed scaling, None for current scaling."""
    specs = tuple(s.replace(" ", "") for s in specs)
    fn = _matmuls_fn(
        specs,
        jnp.dtype(x.dtype).name,
        tuple(jnp.dtype(w.dtype).name for w in weights),
        jnp.dtype(out_dtype or x.dtype).name,
    )
    return fn(x, tuple(weights), history)


def matmul(spec: str, x: jax.Array, w: jax.Array, out_dtype=None, history: jax.Array | None = None) -> jax.Array:
    return matmuls(x, [spec], [w], out_dtype, history)[0]
