"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projection matrices.

A targeted weight W (input axes first, then output axes, e.g. wq [d_model, heads, head_dim])
gets A [inputs..., r] and B [r, outputs...] beside it, named `<W>_lora_a` / `<W>_lora_b`, and
the projection becomes  x W + (alpha / r) * dropout(x) A B.  B starts at zero, so an adapted
model starts exactly at its base. The base is never merged during training: its weight
gradients are not needed (the base is frozen), so the backward pass skips them.

`merge_lora` folds trained adapters into their weights: the result is a plain model's params.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.model.params import param
from lm.model.qtensor import QTensor

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def targeted(spec, name: str) -> bool:
    return spec.lora.rank > 0 and name in spec.lora.targets


def _axes(einsum_spec: str) -> tuple[str, str, str, str]:
    """'btd,dnh->btnh' -> (x axes 'btd', contracted 'd', weight outputs 'nh', result 'btnh')."""
    lhs, out = einsum_spec.split("->")
    xs, ws = lhs.split(",")
    k = "".join(c for c in ws if c in xs)
    o = "".join(c for c in ws if c not in xs)
    if ws != k + o:
        raise ValueError(f"LoRA expects a weight's input axes before its outputs, got '{einsum_spec}'")
    return xs, k, o, out


def lora_delta(module: nn.Module, spec, name: str, x: jax.Array, einsum_spec: str, w_shape, w_names):
    """(alpha / r) * dropout(x) A B for the weight `name` of `module`, in x's dtype.

    Dropout (spec.lora.dropout) applies only when the module was given a 'dropout' rng (training).
    """
    xs, k, o, out = _axes(einsum_spec)
    ws = k + o
    r = spec.lora.rank
    shape_of = lambda axes: tuple(w_shape[ws.index(c)] for c in axes)
    names_of = lambda axes: tuple(w_names[ws.index(c)] for c in axes)
    fan_in = int(np.prod(shape_of(k)))
    # PEFT's default: A uniform in +-1/sqrt(fan_in), B zero
    init_a = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -1.0, 1.0) / fan_in**0.5
    a = param(module, name + SUFFIX_A, init_a, shape_of(k) + (r,), names_of(k) + ("lora_rank",))
    b = param(module, name + SUFFIX_B, nn.initializers.zeros, (r,) + shape_of(o), ("lora_rank",) + names_of(o))
    if spec.lora.dropout > 0 and module.has_rng("dropout"):
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - spec.lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - spec.lora.dropout), 0).astype(x.dtype)
    free = "".join(c for c in xs if c not in k)
    h = jnp.einsum(f"{xs},{k}z->{free}z", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum(f"{free}z,z{o}->{out}", h.astype(x.dtype), b.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * (spec.lora.alpha / r)).astype(x.dtype)


def is_adapter(path) -> bool:
    """Whether a params-tree path (a tuple of keys) names an adapter leaf."""
    name = getattr(path[-1], "key", path[-1])
    return str(name).endswith((SUFFIX_A, SUFFIX_B))


def is_adapter_or_head(path) -> bool:
    """What trains in a LoRA model with a scalar head (a reward model, PPO's value): the adapters and the head."""
    return is_adapter(path) or getattr(path[0], "key", path[0]) == "scalar_head"


def merge_lora(params: dict, alpha: float, rank: int) -> dict:
    """Params with every adapter pair folded into its weight (W + alpha/r * A B) and removed.

    Works on stacked (scanned) and unstacked layers alike: leading axes of W that A does not
    contract are batch axes of the product. Float32 throughout; a 4-bit base weight (QLoRA) is
    dequantized first, adapted or not, so the result is a plain float model.
    """
    out = {}
    for key, value in params.items():
        if not isinstance(value, dict):
            if key.endswith((SUFFIX_A, SUFFIX_B)):
                continue
            a, b = params.get(key + SUFFIX_A), params.get(key + SUFFIX_B)
            if isinstance(value, QTensor):  # a QLoRA base: the weights it trained against, in float32
                value = value.dequantize(jnp.float32)
            out[key] = value if a is None else _fold(value, a, b, alpha / rank)
        else:
            out[key] = merge_lora(value, alpha, rank)
    return out


def _fold(w, a, b, scale: float):
    """W [L..., K..., O...] + scale * A [L..., K..., r] @ B [L..., r, O...] (L: stacked layers)."""
    n_lead = a.ndim + b.ndim - w.ndim - 2
    lead = w.shape[:n_lead]
    n_k = a.ndim - 1 - n_lead
    k, o = w.shape[n_lead : n_lead + n_k], w.shape[n_lead + n_k :]
    size = lambda dims: int(np.prod(dims, dtype=np.int64))
    a3 = jnp.asarray(a, jnp.float32).reshape(size(lead), size(k), a.shape[-1])
    b3 = jnp.asarray(b, jnp.float32).reshape(size(lead), b.shape[n_lead], size(o))
    delta = jnp.einsum("lkr,lro->lko", a3, b3, precision="highest").reshape(w.shape)
    return jnp.asarray(w, jnp.float32) + scale * delta
