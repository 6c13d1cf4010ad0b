"""Kernels for XLA:CPU: matmuls, SwiGLU and norms with hand-written backward passes.

Selected by `model.kernels="cpu"` (what "auto" picks on the CPU backend). Autodiff of a
multi-axis einsum leaves XLA:CPU dot_generals with transposed layouts that it runs through
slow copies and upcasts, and a norm's float32 intermediates kept per layer cost more memory
traffic than its matmuls: these functions spell the backward passes out instead. On GPU and
TPU the same custom VJPs and optimization barriers only keep XLA from fusing, so there the
plain path of `lm.model.layers` (einsum + autodiff) is used. Both give the same values and
gradients (tests/model/test_kernels.py).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model.stash import stash, unstash


def _product(spec: str, a, b, dtype):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


def _weight_grad(a_spec: str, a, g_spec: str, g, out_spec: str, dtype):
    """einsum(a, g -> out) contracting the activation axes, with the narrower operand as the lhs.

    The CPU backend copies the lhs of such a product into a transposed layout, so the operand
    with fewer free elements goes first and the small result is transposed instead.
    """

    def free_size(x_spec, x):
        return math.prod(n for c, n in zip(x_spec, x.shape) if c in out_spec)

    if free_size(a_spec, a) > free_size(g_spec, g):
        a_spec, a, g_spec, g = g_spec, g, a_spec, a
    lhs_free = "".join(c for c in a_spec if c in out_spec)
    order = lhs_free + "".join(c for c in g_spec if c in out_spec and c not in lhs_free)
    y = _product(f"{a_spec},{g_spec}->{order}", a, g, dtype)
    if order == out_spec:
        return y
    # The barrier stops XLA from folding the transpose back into the product's operands.
    return jnp.transpose(jax.lax.optimization_barrier(y), [order.index(c) for c in out_spec])


@functools.lru_cache(maxsize=None)
def _matmuls_fn(x_spec: str, outs: tuple[str, ...], w_specs: tuple[str, ...], x_dtype: str, out_dtype: str):
    """Products of one activation with several weights, float32 accumulation, explicit backward.

    Autodiff of a multi-axis einsum leaves XLA dot_generals with transposed layouts that
    the CPU backend runs through slow copies and upcasts; spelling the gradient einsums out
    keeps every product on the fast matmul path. The activation is kept once for all the
    products (not once per weight), and the weights stay in their own (float32) dtype as
    residuals: each is cast to the compute dtype where it is used, and its gradient is
    accumulated straight into that dtype instead of being rounded to the compute dtype.
    """
    dt = jnp.dtype(x_dtype)

    @jax.custom_vjp
    def matmuls(x, ws):
        return tuple(
            _product(f"{x_spec},{ws_}->{o}", x, w.astype(dt), out_dtype) for o, ws_, w in zip(outs, w_specs, ws)
        )

    def forward(x, ws):
        return matmuls(x, ws), (stash(x), ws)

    def backward(saved, gs):
        x, ws = unstash(saved[0], dt), saved[1]
        dxs = [
            _product(f"{o},{ws_}->{x_spec}", g, w.astype(dt), jnp.float32 if len(ws) > 1 else dt)
            for o, ws_, w, g in zip(outs, w_specs, ws, gs)
        ]
        dws = tuple(_weight_grad(x_spec, x, o, g, ws_, w.dtype) for o, ws_, w, g in zip(outs, w_specs, ws, gs))
        return sum(dxs[1:], dxs[0]).astype(dt), dws

    matmuls.defvjp(forward, backward)
    return matmuls


def matmuls(x: jax.Array, specs, weights, out_dtype: str | None = None) -> tuple[jax.Array, ...]:
    """`jnp.einsum(spec, x, w)` for each (spec, w), computed in x's dtype with float32 accumulation.

    All specs share x's subscripts. Weights may be float32 params: they are cast to x's
    dtype for the product, and their gradients come back in their own dtype.
    """
    specs = [s.replace(" ", "") for s in specs]
    x_spec = specs[0].split(",")[0]
    if any(s.split(",")[0] != x_spec for s in specs):
        raise ValueError(f"matmuls: specs {specs} do not share the activation's subscripts")
    w_specs = tuple(s.split(",")[1].split("->")[0] for s in specs)
    outs = tuple(s.split("->")[1] for s in specs)
    fn = _matmuls_fn(x_spec, outs, w_specs, jnp.dtype(x.dtype).name, jnp.dtype(out_dtype or x.dtype).name)
    return fn(x, tuple(weights))


def matmul(spec: str, x: jax.Array, w: jax.Array, out_dtype: str | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype with float32 accumulation (see `matmuls`)."""
    return matmuls(x, [spec], [w], out_dtype)[0]


@jax.custom_vjp
def swiglu_down(gate: jax.Array, up: jax.Array, w: jax.Array) -> jax.Array:
    """(silu(gate) * up) @ w for [B, T, F] activations and a [F, D] weight (cast to gate's dtype).

    The backward pass recomputes silu(gate) * up from the saved gate and up rather than
    keeping a third [B, T, F] activation per layer until the backward pass.
    """
    return _product("btf,fd->btd", _swiglu(gate, up).astype(gate.dtype), w.astype(gate.dtype), gate.dtype)


def _swiglu(gate, up):
    """silu(gate) * up in float32 (one rounding to the compute dtype, by the caller)."""
    return nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def _swiglu_down_fwd(gate, up, w):
    return swiglu_down(gate, up, w), (stash(gate), stash(up), w)


def _swiglu_down_bwd(saved, g):
    dt = g.dtype
    gate, up, w = unstash(saved[0], dt), unstash(saved[1], dt), saved[2]
    gf, uf = gate.astype(jnp.float32), up.astype(jnp.float32)
    sig = jax.nn.sigmoid(gf)
    silu = gf * sig
    dh = _product("btd,fd->btf", g, w.astype(dt), jnp.float32)
    d_gate = dh * uf * sig * (1 + gf * (1 - sig))
    d_w = _weight_grad("btf", _swiglu(gate, up).astype(dt), "btd", g, "fd", w.dtype)
    return d_gate.astype(dt), (dh * silu).astype(dt), d_w


swiglu_down.defvjp(_swiglu_down_fwd, _swiglu_down_bwd)


def scale_norm(x: jax.Array, scale: jax.Array, centered: bool, eps: float) -> jax.Array:
    """x normalised over its last axis, times scale, in float32: RMSNorm, or LayerNorm if centered.

    The backward pass works from the saved input (in its own, usually 16-bit, dtype) and the
    per-row inverse norm, instead of the float32 intermediates autodiff would keep per layer.
    """
    return _scale_norm(x, scale, centered, eps, jnp.dtype(x.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _scale_norm(x, scale, centered, eps, x_dtype):
    return _normalized(x, centered, eps)[0] * scale


def _normalized(x, centered, eps):
    """(x_hat, 1/norm): x_hat = (x - mean if centered) / sqrt(mean square + eps), in float32."""
    xf = x.astype(jnp.float32)
    if centered:
        xf = xf - xf.mean(-1, keepdims=True)
    inv = jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
    return xf * inv, inv


def _scale_norm_fwd(x, scale, centered, eps, x_dtype):
    x_hat, inv = _normalized(x, centered, eps)
    return x_hat * scale, (stash(x), scale, inv)


def _scale_norm_bwd(centered, eps, x_dtype, saved, g):
    x, scale, inv = unstash(saved[0], x_dtype), saved[1], saved[2]
    xf = x.astype(jnp.float32)
    if centered:
        xf = xf - xf.mean(-1, keepdims=True)
    x_hat, g = xf * inv, g.astype(jnp.float32)
    d_scale = jnp.sum(g * x_hat, axis=tuple(range(g.ndim - 1)))
    d_hat = g * scale
    dx = d_hat - x_hat * jnp.mean(d_hat * x_hat, -1, keepdims=True)
    if centered:
        dx = dx - jnp.mean(d_hat, -1, keepdims=True)
    return (inv * dx).astype(x.dtype), d_scale


_scale_norm.defvjp(_scale_norm_fwd, _scale_norm_bwd)
