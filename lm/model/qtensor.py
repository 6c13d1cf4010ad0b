"""A weight stored as small integers and float scales, and its dequantization.

A `QTensor` stands in a params tree where a float matmul weight was (`lm.model.quant` makes
them). The float weight's axes are: leading ones (the stacked `layers` axis, the embedding's
vocab rows), then its contracting (input) axes starting at `axis` (counted from the end, so
slicing off a leading layer axis in a scan changes nothing), then its output axes.

- 8 bits: `values` int8 of the weight's shape, symmetric, one float32 scale per output
  channel: `scale` has the weight's shape with 1 on each contracting axis.
- 4 bits: the contracting axes flattened into one axis of K, cut into groups of `group`
  consecutive inputs, each with its own scale per output channel: `scale` is
  [..., K / group, outputs...]. `values` is uint8 [..., K / 2, outputs...]: two signed 4-bit
  values per byte (input 2i in the low nibble, 2i + 1 in the high one). Packing by hand keeps
  it 4 bits on every backend: XLA:CPU stores jnp.int4 in a byte per value.
- 4 bits, NormalFloat (`code="nf4"`, QLoRA's NF4): the same layout, each nibble an index into
  `NF4` (16 quantiles of a normal distribution scaled to [-1, 1]) and the scale the group's max |w|.
- Double-quantized scales (`scale_max` given, the LoRA base of lm.model.quant.quantize_base):
  `scale` is uint8 codes and a group's scale is code * scale_max / 255, scale_max float32 being
  [..., 1, outputs...] (the largest scale of each output channel). Codes are rounded up (less a
  hundredth of a step), so a group's scale does not drop below its max |w| by more than that.

A layer's matmul reads a stored QTensor as it is (`lm.model.params.param(..., quantized=True)`)
and multiplies with it through `lm.model.qdot`, which builds no float weight; other readers get
it dequantized where they read it. `T`, `reshape` (of the contracting axes) and `take` (rows of a
leading axis) give the views the layers take of a float weight.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    values: jax.Array
    scale: jax.Array
    bits: int = dataclasses.field(metadata={"static": True})
    axis: int = dataclasses.field(metadata={"static": True})  # first contracting axis, < 0
    k_shape: tuple = dataclasses.field(metadata={"static": True})  # the contracting axes' sizes
    group: int = dataclasses.field(metadata={"static": True})  # inputs per scale (4 bits); 0 for 8 bits
    code: str = dataclasses.field(default="int", metadata={"static": True})  # 4 bits: "int" | "nf4"
    scale_max: jax.Array | None = None  # double-quantized scales: scale is uint8 codes (see above)

    @property
    def shape(self) -> tuple:
        """The float weight's shape."""
        if self.bits == 8:
            return tuple(self.values.shape)
        p = self.values.ndim - 1 + len(self.k_shape) + self.axis
        return tuple(self.values.shape[:p]) + tuple(self.k_shape) + tuple(self.values.shape[p + 1 :])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))

    @property
    def T(self) -> QTensor:
        """A 2-D weight transposed (the embedding table [vocab, d] read as the LM head [d, vocab])."""
        if self.values.ndim != 2 or len(self.k_shape) != 1:
            raise ValueError(f"QTensor.T: a 2-D weight with one contracting axis, not {self.shape}")
        if self.scale_max is not None:
            raise ValueError("QTensor.T: not for double-quantized scales (the LoRA base quantizes no table)")
        return dataclasses.replace(self, values=self.values.T, scale=self.scale.T, axis=-1 - (2 + self.axis))

    def reshape(self, *shape) -> QTensor:
        """The same weight with its contracting axes merged or split, its other axes as they are
        (attention's output projection [heads, head_dim, d] read as [heads * head_dim, d])."""
        full, n_k = self.shape, len(self.k_shape)
        p = len(full) + self.axis
        lead, outs = full[:p], full[p + n_k :]
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        known = math.prod(n for n in shape if n != -1)
        shape = tuple(math.prod(full) // known if n == -1 else n for n in shape)
        k_shape = shape[len(lead) : len(shape) - len(outs)]
        if (
            shape[: len(lead)] != lead
            or shape[len(shape) - len(outs) :] != outs
            or math.prod(k_shape) != math.prod(self.k_shape)
        ):
            raise ValueError(f"QTensor.reshape {full} -> {shape}: only the contracting axes {self.k_shape} may change")
        axis = -len(k_shape) - len(outs)
        if self.bits == 4:  # stored with the contracting axes already flattened
            return dataclasses.replace(self, axis=axis, k_shape=k_shape)
        scale = self.scale.reshape(lead + (1,) * len(k_shape) + outs)
        return QTensor(self.values.reshape(shape), scale, 8, axis, k_shape, 0)

    def take(self, ids: jax.Array) -> QTensor:
        """The entries `ids` of the first axis (a leading one: the embedding table's rows), still quantized."""
        if len(self.shape) + self.axis < 1:
            raise ValueError(f"QTensor.take: the first axis of {self.shape} is a contracting one")
        take = lambda a: None if a is None else jnp.take(a, ids, axis=0)
        return dataclasses.replace(
            self, values=take(self.values), scale=take(self.scale), scale_max=take(self.scale_max)
        )

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight (products and scaling in float32, rounded once to `dtype`)."""
        if self.bits == 8:
            return (self.values.astype(jnp.float32) * self.scale).astype(dtype)
        p = self.values.ndim - 1 + len(self.k_shape) + self.axis  # the packed axis
        q = unpack_int4(self.values, p)
        levels = jnp.asarray(NF4)[q.astype(jnp.int32) + 8] if self.code == "nf4" else q.astype(jnp.float32)
        k = math.prod(self.k_shape)
        grouped = levels.reshape(q.shape[:p] + (k // self.group, self.group) + q.shape[p + 1 :])
        w = grouped * jnp.expand_dims(self.group_scale(), p + 1)
        return w.reshape(self.shape).astype(dtype)

    def group_scale(self) -> jax.Array:
        """The float32 scale of each group (4 bits): stored, or decoded from double-quantized codes."""
        if self.scale_max is None:
            return self.scale
        return self.scale.astype(jnp.float32) * (self.scale_max / 255)


# QLoRA's NormalFloat4 levels (Dettmers et al. 2023, appendix E): nibble i - 8 stands for NF4[i]
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def pack_int4(q: jax.Array, axis: int) -> jax.Array:
    """int values in [-8, 7] -> uint8 with `axis` halved: element 2i low nibble, 2i + 1 high."""
    u = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    lo = jax.lax.slice_in_dim(u, 0, None, 2, axis)
    hi = jax.lax.slice_in_dim(u, 1, None, 2, axis)
    return lo | (hi << 4)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """The inverse of `pack_int4`: int8 values with `axis` doubled."""
    signed = lambda nibble: (nibble.astype(jnp.int8) ^ 8) - 8  # two's complement of 4 bits
    lo, hi = signed(packed & 0xF), signed(packed >> 4)
    both = jnp.stack([lo, hi], axis=axis + 1)
    return both.reshape(packed.shape[:axis] + (2 * packed.shape[axis],) + packed.shape[axis + 1 :])
