"""Products of activations with quantized weights (`QTensor`) that build no float weight.

An int8 weight's scale is one per output channel, so it factors out of the contraction:
x @ (q * s) = (x @ q) * s. The int8 values enter the dot and the scale multiplies its output.
Two forms of that dot, one per kind of backend (`int_dot`: the model's CPU kernel path):

- convert-in-dot (TPU, GPU): dot_general(x, convert(q) to x's dtype), float32 accumulation.
  The TPU compiler fuses the convert into the dot's operand, so the weight is read from memory
  as int8 and no converted copy is written (tests/model/test_qdot_tpu.py compiles a decode step).
- int8 x int8 (XLA:CPU): each row of x becomes two int8 terms, x ~ hs * hi + ls * lo (hi: x on
  a grid of max|x| / 127 over the contracting axes; lo: the remainder on its own, 127 times
  finer grid); both go through one s8 x s8 -> s32 dot and y = (hs * acc_hi + ls * acc_lo) * s.
  XLA:CPU does not fuse a convert into a dot: it writes a converted copy of the weight first,
  and a one-row dot of any type but float32 gets one too (float32; int32 for s8 x s8). An s8 dot
  of two or more rows goes to YNNPACK whole, reading the int8 weight in place. The second term keeps x to
  ~14 bits (finer than bfloat16), so the product is that of dequantize-then-matmul to ~3e-5,
  and it makes a decode step's one row two, at no cost for a memory-bound product.

int4 and NF4 (two values per byte, a scale per group of inputs) are dequantized in the compute
dtype where they are read, as before: unpacking the nibbles is itself a pass that writes the weight
out on XLA:CPU, and per-group int8 dots after it made the decode step 5-9x slower than that. Their
gradient (QLoRA: a frozen 4-bit base under trained adapters) dequantizes the weight again in the
backward pass: plain autodiff would keep every layer's dequantized weight from the forward scan
until the backward (a float copy of the whole base; measured on the tiny model without remat).

The int8 x int8 product carries a custom gradient (that of x @ dequantized w): rounding x would
otherwise give the activations a zero gradient.

Measured (docs/generation.md#quantization has the tables): on a 2-core CPU one row times eight
1024 x 4096 weights takes ~0.8 ms a weight from int8 against ~6 ms dequantized first (float32
weights ~0.65 ms, bfloat16 ones ~5 ms). Decoding a 143 MB int8 model (bf16
compute) runs 1.6x faster than before at batch 1 (1.5x the bfloat16 weights' speed) and 0.9x at
batch 16, where the second term doubles the dot's rows: one term measured 1.05x the bfloat16
weights' speed there, at 1.4x the logits error, so the exact form is kept. On an H200 XLA fuses
the convert into a Triton GEMM: int8 decodes 1.09x faster than bfloat16 weights (batch 1 and 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.model.qtensor import QTensor

_PAIR = "Z"  # the label of the (hi, lo) axis: einsum specs here use lowercase letters


def qdot(spec: str, x: jax.Array, w, out_dtype=None, int_dot: bool = False) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with float32 accumulation, in `out_dtype` (default x's dtype).
    w: a float weight (the plain product) or a QTensor whose contracting axes are the spec's."""
    out = jnp.dtype(out_dtype or x.dtype)
    if not isinstance(w, QTensor):
        return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out)
    xl, wl, ol, kl = _labels(spec, w)
    if w.bits == 4:
        return _dequantized_dot(spec, x, w).astype(out)
    if int_dot:
        return _int_product(spec, x, w).astype(out)
    y = jnp.einsum(spec, x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * _along(_squeeze(w.scale, wl, kl), _drop(wl, kl), ol)).astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dequantized_dot(spec: str, x, w: QTensor) -> jax.Array:
    return jnp.einsum(spec, x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)


def _dequantized_fwd(spec, x, w):
    return _dequantized_dot(spec, x, w), (w, jnp.zeros((), x.dtype))  # the 4-bit weight, not its float copy


def _dequantized_bwd(spec, saved, g):
    w, like = saved
    ins, ol = spec.split("->")
    xl, wl = ins.split(",")
    dx = jnp.einsum(
        f"{ol},{wl}->{xl}", g.astype(like.dtype), w.dequantize(like.dtype), preferred_element_type=jnp.float32
    )
    return dx.astype(like.dtype), None  # a frozen weight: no gradient


_dequantized_dot.defvjp(_dequantized_fwd, _dequantized_bwd)


def take_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """table[ids] in `dtype`: an embedding lookup. A QTensor table gives its rows' values and
    scales first, so only the rows looked up are dequantized."""
    if isinstance(table, QTensor):
        return table.take(ids).dequantize(dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


def _labels(spec: str, w: QTensor) -> tuple[str, str, str, str]:
    """(x, w, out, contracting) labels; the contracting ones are w's stored input axes, in order."""
    ins, ol = spec.split("->")
    xl, wl = ins.split(",")
    p = len(wl) + w.axis
    kl = wl[p : p + len(w.k_shape)]
    if set(kl) != (set(xl) & set(wl)) - set(ol) or not set(wl) - set(kl) <= set(ol):
        raise ValueError(f"qdot {spec!r}: the quantized weight contracts its axes {kl!r} and keeps the others")
    return xl, wl, ol, kl


def _drop(labels: str, gone: str) -> str:
    return "".join(c for c in labels if c not in gone)


def _squeeze(a, labels: str, gone: str):
    """a without its axes labelled `gone` (each of size 1)."""
    return a.reshape([n for c, n in zip(labels, a.shape) if c not in gone])


def _along(a, labels: str, out: str):
    """a (axes `labels`, each one of `out`'s) transposed and given 1s to broadcast against `out`."""
    order = sorted(range(len(labels)), key=lambda i: out.index(labels[i]))
    a = jnp.transpose(a, order)
    sizes = {labels[i]: a.shape[j] for j, i in enumerate(order)}
    return a.reshape([sizes.get(c, 1) for c in out])


def _two_terms(x, xl: str, kl: str):
    """x as int8 [2, *x.shape] (hi, lo) and their float32 scales, max |row| / 127 over `kl`."""
    axes = tuple(i for i, c in enumerate(xl) if c in kl)

    def grid(v):
        amax = jnp.max(jnp.abs(v), axis=axes, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127, 1.0)
        return jnp.round(v / scale), scale

    xf = x.astype(jnp.float32)
    hi, hs = grid(xf)
    lo, ls = grid(xf - hi * hs)
    return jnp.stack([hi, lo]).astype(jnp.int8), jnp.stack([hs, ls])


def _int_product(spec: str, x, w: QTensor) -> jax.Array:
    xl, _, _, kl = _labels(spec, w)
    both, scales = _two_terms(x, xl, kl)  # outside the custom gradient: products of one x share it
    return _int_dot(spec, str(x.dtype), x, both, scales, w)


def _int_forward(spec: str, both, scales, w: QTensor) -> jax.Array:
    xl, wl, ol, kl = _labels(spec, w)
    z = _PAIR
    acc = jnp.einsum(f"{z}{xl},{wl}->{z}{ol}", both, w.values, preferred_element_type=jnp.int32).astype(jnp.float32)
    rows = _along(_squeeze(scales, z + xl, kl), z + _drop(xl, kl), z + ol)
    # two products, not a sum over the pair: a YNNPACK reduction of that length-2 axis crashed
    # XLA:CPU in the engine's prefill step
    y = acc[0] * rows[0] + acc[1] * rows[1]
    return y * _along(_squeeze(w.scale, wl, kl), _drop(wl, kl), ol)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _int_dot(spec: str, x_dtype: str, x, both, scales, w: QTensor) -> jax.Array:
    return _int_forward(spec, both, scales, w)


def _int_fwd(spec, x_dtype, x, both, scales, w):
    return _int_forward(spec, both, scales, w), (scales, w)


def _int_bwd(spec, x_dtype, saved, g):
    scales, w = saved
    ins, ol = spec.split("->")
    xl, wl = ins.split(",")
    dx = jnp.einsum(f"{ol},{wl}->{xl}", g.astype(x_dtype), w.dequantize(x_dtype), preferred_element_type=jnp.float32)
    return dx.astype(x_dtype), None, jnp.zeros_like(scales), None


_int_dot.defvjp(_int_fwd, _int_bwd)
