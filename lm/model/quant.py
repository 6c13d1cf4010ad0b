"""Weight-only quantization for inference: int8 per output channel, int4 in groups of inputs.

`quantize_for_inference(built, params, mode)` turns a model's float params into placed params
whose large matmul weights are `QTensor`s (lm.model.qtensor: the layout and the dequantization).
The layers multiply with them through `lm.model.qdot` (int8: the scale after the dot, no float
weight; int4 and MoE experts: dequantized where read), so the decoder, the KV-cache decode step
and every caller of `model.apply` run on them unchanged.

What is quantized (`CONTRACTING`): attention wq/wk/wv/wo, the MLP's w_gate/w_up/w_in/w_down, the
untied LM head and the embedding table. The table is quantized per row (int4: in groups along
d_model): tied, it is the LM head, a matmul read whole on every step; untied, it is still often
the largest single tensor, and a row's scale serves the lookup as it serves the head (the lookup
takes its rows' values and scales and dequantizes those alone). Norms, biases, LoRA adapters,
learned position tables and the scalar head stay as they are.

- int8: symmetric, scale = max |w| / 127 over the contracting axes, one per output channel.
- int4: symmetric, scale = max |w| / 7 per group of `GROUP` consecutive inputs (the contracting
  axes flattened; the group is gcd(K, 128), so 128 whenever K is a multiple of 128) and output
  channel; two values packed per uint8 byte (XLA:CPU would store jnp.int4 in a whole byte).

Placement: values keep their weight's sharding; a scale is sharded like its weight's output
axes and replicated along the reduced contracting axes (int4: the flattened contracting axis,
values and scales alike, takes the first contracting axis's mesh split when it divides).

Why not Qwix (0.1.8, with flax 0.12.8 and jax 0.10.2, tried on this model on CPU): its PTQ
`quantize_params` takes the per-layer "how to quantize" recorded inside `nn.scan` (channel axes
counted without the layer axis) and applies it to the stacked [layers, ...] weight, so wk's
scales came out [1, d_model, kv_heads, 1] (per input channel, shared by all layers) instead of
[layers, 1, kv_heads, head_dim], which the scan then cannot slice; its quantized weight also
fails `w.astype(...)` (used by every matmul here: "Unsupported type: QArray"), refuses a
`reshape` (the decode step flattens wo), and under a rule covering the attention module its
dot_general drops `preferred_element_type`, which the cached attention relies on for float32
logits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.errors import UserError
from lm.model.qtensor import NF4, QTensor, pack_int4
from lm.sharding import place_leaf, split_count

MODES = {"int8": 8, "int4": 4}
GROUP = 128
# leaf name -> (first contracting axis counted from the end of the weight, number of contracting axes)
CONTRACTING = {
    "wq": (-3, 1),
    "wk": (-3, 1),
    "wv": (-3, 1),
    "wo": (-3, 2),
    "w_gate": (-2, 1),
    "w_up": (-2, 1),
    "w_in": (-2, 1),
    "w_down": (-2, 1),
    "head": (-2, 1),
    "embedding": (-1, 1),
}
SUFFIXES = {8: ".q8", 4: ".q4"}  # quantized_tensors' names: values (int8 / packed uint8) and ".scale"


def bits_of(mode: str) -> int:
    if mode not in MODES:
        raise UserError(f"quantize: {mode!r}: expected one of {', '.join(MODES)}")
    return MODES[mode]


def quantize(w, bits: int, axis: int, n_k: int, group: int = GROUP, code: str = "int", double: bool = False) -> QTensor:
    """One float weight -> QTensor (jnp: runs on device, under jit or not). 4 bits: `code` int or
    nf4, `double` for double-quantized scales (lm.model.qtensor)."""
    w = jnp.asarray(w).astype(jnp.float32)
    p = w.ndim + axis
    k_shape = tuple(w.shape[p : p + n_k])
    if bits == 8:
        k_axes = tuple(range(p, p + n_k))
        scale = _scale(jnp.max(jnp.abs(w), axis=k_axes, keepdims=True), 127)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return QTensor(q, scale, 8, axis, k_shape, 0)
    k = math.prod(k_shape)
    g = math.gcd(k, group)
    if k % 2:
        raise UserError(f"quantize int4: a weight of shape {w.shape} has {k} inputs; packing needs an even number")
    grouped = w.reshape(w.shape[:p] + (k // g, g) + w.shape[p + n_k :])
    scale = _scale(jnp.max(jnp.abs(grouped), axis=p + 1), 1 if code == "nf4" else 7)
    scale_max = None
    if double:  # values are rounded against the scale as it will be decoded
        scale_max = jnp.max(scale, axis=p, keepdims=True)
        # rounded up, less a hundredth of a step: a ratio within an ulp of a whole code must not
        # round two ways in two programs (a mesh's and one device's compile divide differently)
        scale = jnp.clip(jnp.ceil(scale / scale_max * 255 - 0.01), 1, 255).astype(jnp.uint8)
    stored = QTensor(jnp.zeros((), jnp.uint8), scale, 4, axis, k_shape, g, code, scale_max)
    x = grouped / jnp.expand_dims(stored.group_scale(), p + 1)
    if code == "nf4":  # the nearest level: how many midpoints between levels lie below, as a signed nibble
        # (elementwise compares, not jnp.searchsorted: its scan broke on sharded inputs)
        q = sum((x > m).astype(jnp.int32) for m in NF4_MIDPOINTS) - 8
    else:
        q = jnp.clip(jnp.round(x), -7, 7)
    values = pack_int4(q.reshape(w.shape[:p] + (k,) + w.shape[p + n_k :]), p)
    return dataclasses.replace(stored, values=values)


NF4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(NF4[:-1], NF4[1:]))


def _scale(amax, top: int):
    return jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)  # an all-zero channel keeps scale 1


def is_quantized(x) -> bool:
    return isinstance(x, QTensor)


def _map_named(fn, tree: dict, *rest: dict, path: tuple = ()) -> dict:
    """fn(path, leaf, *rest_leaves) over a nested dict of params (a QTensor is one leaf)."""
    return {
        k: _map_named(fn, v, *(r[k] for r in rest), path=path + (k,))
        if isinstance(v, dict)
        else fn(path + (k,), v, *(r[k] for r in rest))
        for k, v in tree.items()
    }


def _check_inputs(path: tuple, shape: tuple, spec) -> None:
    """A quantized weight's contracting size must be the spec's: params of another model fail here."""
    name = path[-1]
    d_ff = spec.moe.shared_d_ff if "shared" in path else spec.moe.expert_d_ff if "moe" in path else spec.mlp.d_ff
    want = (
        spec.attention.n_heads * spec.attention.head_dim if name == "wo" else d_ff if name == "w_down" else spec.d_model
    )
    axis, n_k = CONTRACTING[name]
    got = math.prod(shape[len(shape) + axis : len(shape) + axis + n_k])
    if got != want:
        raise UserError(f"quantize: {'/'.join(path)} {tuple(shape)} has {got} inputs; the model's spec says {want}")


def quantize_params(params: dict, spec, mode: str) -> dict:
    """A params tree with its large matmul weights (`CONTRACTING`) quantized; the rest as given.
    Computed where the leaves are (numpy leaves: on the default device)."""
    bits = bits_of(mode)

    def one(path, x):
        if path[-1] not in CONTRACTING or is_quantized(x):
            return x
        _check_inputs(path, x.shape, spec)
        return _quantizer(bits, *CONTRACTING[path[-1]])(x)

    return _map_named(one, params)


@functools.lru_cache(maxsize=None)
def _quantizer(bits: int, axis: int, n_k: int, out_shardings=None, **how):
    """how: quantize's group, code and double."""
    return jax.jit(functools.partial(quantize, bits=bits, axis=axis, n_k=n_k, **how), out_shardings=out_shardings)


# ---- placement ---------------------------------------------------------------------------------


def quantized_sharding(q: QTensor, sharding: NamedSharding) -> QTensor:
    """The shardings of a QTensor (or its abstract shape) whose float weight has `sharding`."""
    mesh, ndim = sharding.mesh, len(q.shape)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    p = ndim + q.axis
    n_k = len(q.k_shape)

    def fit(entries, shape):
        return NamedSharding(
            mesh,
            PartitionSpec(
                *[e if e is not None and n % split_count(mesh, e) == 0 else None for e, n in zip(entries, shape)]
            ),
        )

    if q.bits == 8:
        reduced = spec[:p] + (None,) * n_k + spec[p + n_k :]
        return QTensor(fit(spec, q.values.shape), fit(reduced, q.scale.shape), q.bits, q.axis, q.k_shape, q.group)
    flat = spec[:p] + (spec[p],) + spec[p + n_k :]  # the flattened contracting axis follows the first one
    scale_max = None if q.scale_max is None else fit(flat, q.scale_max.shape)
    return dataclasses.replace(q, values=fit(flat, q.values.shape), scale=fit(flat, q.scale.shape), scale_max=scale_max)


def _abstract(bits: int, axis: int, n_k: int, shape: tuple, **how) -> QTensor:
    return jax.eval_shape(
        functools.partial(quantize, bits=bits, axis=axis, n_k=n_k, **how), jax.ShapeDtypeStruct(shape, jnp.float32)
    )


def quantize_for_inference(built, params: dict, mode: str) -> dict:
    """This model's float params (host numpy, lazy or placed leaves) -> quantized params on
    `built`'s mesh, ready for `built.module` (Generator, decode_step, model.apply, scoring).

    Leaf by leaf: a float weight is placed with its sharding, quantized on its devices into its
    QTensor's shardings, and let go, so at most one float weight beside the quantized ones is held."""
    bits = bits_of(mode)
    built.check(params, "params to quantize")

    def one(path, x, sharding):
        if is_quantized(x):
            return place_quantized_leaf(x, sharding)
        if path[-1] not in CONTRACTING:
            return place_leaf(x, sharding)
        _check_inputs(path, x.shape, built.spec)
        axis, n_k = CONTRACTING[path[-1]]
        out = quantized_sharding(_abstract(bits, axis, n_k, tuple(x.shape)), sharding)
        return _quantizer(bits, axis, n_k, out)(place_leaf(x, sharding))

    return _map_named(one, params, _subtree(built.param_shardings, params))


def abstract_quantized(built, mode: str) -> dict:
    """The quantized params of `built`'s model as ShapeDtypeStructs with their shardings (QTensors
    of them for the quantized weights): a quantized program compiled ahead of time takes these."""
    bits = bits_of(mode)

    def one(path, a, sharding):
        if path[-1] not in CONTRACTING:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        q = _abstract(bits, *CONTRACTING[path[-1]], tuple(a.shape))
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), q, quantized_sharding(q, sharding)
        )

    return _map_named(one, built.abstract_params(), built.param_shardings)


def place_quantized_leaf(q: QTensor, sharding: NamedSharding) -> QTensor:
    """A host QTensor (numpy values and scale) on the mesh: values and scale with their shardings."""
    return jax.tree.map(place_leaf, q, quantized_sharding(q, sharding))


def place_quantized(built, qparams: dict) -> dict:
    """A quantized params tree (e.g. read back by `from_tensors`) on `built`'s mesh."""
    built.check(qparams, "quantized params")
    place = lambda path, x, sh: place_quantized_leaf(x, sh) if is_quantized(x) else place_leaf(x, sh)
    return _map_named(place, qparams, _subtree(built.param_shardings, qparams))


def _subtree(tree: dict, like: dict) -> dict:
    return {k: _subtree(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


# ---- the frozen base of a LoRA run (QLoRA) -----------------------------------------------------

# model.lora_base_quant -> how its layers' weights are stored: 4 bits in groups of BASE_GROUP inputs
# (QLoRA's NF4 block), with double-quantized scales (lm.model.qtensor). The embedding table and
# the LM head stay as given, as QLoRA keeps them.
BASE_QUANT = {"nf4": dict(code="nf4"), "int4": dict(code="int")}
BASE_GROUP = 64
BASE_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_in", "w_down")


def _base_how(mode: str) -> dict:
    return dict(group=BASE_GROUP, double=True, **BASE_QUANT[mode])


def quantize_base(built, base: dict, mode: str) -> dict:
    """A LoRA run's frozen params (host, lazy or placed leaves) on `built`'s mesh, its layers'
    weights 4-bit: placed, quantized on their devices and let go leaf by leaf."""
    how = _base_how(mode)

    def one(path, x, sharding):
        if path[-1] not in BASE_WEIGHTS or is_quantized(x):
            return place_quantized_leaf(x, sharding) if is_quantized(x) else place_leaf(x, sharding)
        axis, n_k = CONTRACTING[path[-1]]
        out = quantized_sharding(_abstract(4, axis, n_k, tuple(x.shape), **how), sharding)
        return _quantizer(4, axis, n_k, out, **how)(place_leaf(x, sharding))

    return _map_named(one, base, _subtree(built.param_shardings, base))


def abstract_base(abstract: dict, shardings: dict, mode: str, dtype=None) -> dict:
    """The frozen params' ShapeDtypeStructs with their shardings as `quantize_base` makes them
    (QTensors of them for the 4-bit weights); other floating leaves in `dtype` when given.
    mode "none": nothing quantized."""

    def one(path, a, sharding):
        if mode == "none" or path[-1] not in BASE_WEIGHTS:
            dt = dtype if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
            return jax.ShapeDtypeStruct(a.shape, dt, sharding=sharding)
        q = _abstract(4, *CONTRACTING[path[-1]], tuple(a.shape), **_base_how(mode))
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), q, quantized_sharding(q, sharding)
        )

    return _map_named(one, abstract, shardings)


def base_shardings(abstract: dict, shardings: dict, mode: str) -> dict:
    """The shardings of the frozen params as `quantize_base` places them."""
    return jax.tree.map(lambda a: a.sharding, abstract_base(abstract, shardings, mode))


# ---- bytes and export --------------------------------------------------------------------------


def weight_bytes(params: dict) -> dict:
    """{'all': bytes of every leaf, 'quantized': bytes of the quantized weights (values + scales)}."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    return {"all": sum(int(x.nbytes) for x in leaves), "quantized": sum(x.nbytes for x in leaves if is_quantized(x))}


def quantized_tensors(qparams: dict) -> dict[str, np.ndarray]:
    """Flat host tensors named by params path ('blocks/attn/wq'). A quantized weight becomes two:
    '<path>.q8' (int8, the weight's shape) or '<path>.q4' (uint8, two 4-bit values per byte along
    the flattened contracting axis), and '<path>.scale' (float32; see lm.model.qtensor)."""
    out = {}

    def one(path, x):
        name = "/".join(path)
        if is_quantized(x):
            out[name + SUFFIXES[x.bits]] = np.asarray(x.values)
            out[name + ".scale"] = np.asarray(x.scale)
        else:
            out[name] = np.asarray(x)

    _map_named(one, qparams)
    return out


def from_tensors(tensors: dict, abstract: dict) -> dict:
    """The inverse of `quantized_tensors`: a nested params tree of host leaves and QTensors.
    abstract: the model's params shapes (`Built.abstract_params()`), which give each weight's
    contracting axes."""
    by_bits = {suffix: bits for bits, suffix in SUFFIXES.items()}

    def one(path, a):
        name = "/".join(path)
        if name in tensors:
            return tensors[name]
        for suffix, bits in by_bits.items():
            if name + suffix in tensors:
                values, scale = tensors[name + suffix], tensors[name + ".scale"]
                axis, n_k = CONTRACTING[path[-1]]
                p = len(a.shape) + axis
                k_shape = tuple(a.shape[p : p + n_k])
                group = 0 if bits == 8 else math.prod(k_shape) // scale.shape[p]
                return QTensor(values, scale, bits, axis, k_shape, group)
        raise UserError(f"quantized tensors: no '{name}' (nor '{name}.q8' / '{name}.q4')")

    return _map_named(one, abstract)
