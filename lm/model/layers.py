"""Building blocks: logically-partitioned params, norms, MLPs, sharding constraints, and the
matmul / norm kernels of the two paths (plain einsum + autodiff, or `lm.model.cpu_kernels`);
a quantized weight's products go through `lm.model.qdot`, and the blocks' projections of a
`spec.fp8` model through `lm.model.fp8`."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from lm.model import cpu_kernels, fp8
from lm.model.lora import lora_delta, targeted
from lm.model.params import param
from lm.model.qdot import qdot
from lm.model.qtensor import QTensor
from lm.model.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """Where activations go: a mesh and the logical-axis rule table (None mesh = no constraints)."""

    mesh: Mesh | None = None
    rules: tuple = ()

    def constrain(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        if self.mesh is None:
            return x
        spec = nn.logical_to_mesh_axes(names, self.rules)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


class AmaxHistory(nn.Module):
    """One fp8 product site's amax history: a child module so that adding it leaves the parent's
    other params' init (Flax draws them from the parent's RNG counter) as without it."""

    shape: tuple[int, int]

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("amax_history", nn.with_logical_partitioning(nn.initializers.zeros, (None, None)), self.shape)


def fp8_history(module: nn.Module, name: str, n_weights: int) -> jax.Array | None:
    """The amax history of one fp8 product site of `module` under delayed scaling (the param
    `fp8_<name>/amax_history`, zeros at first: lm.model.fp8), None otherwise."""
    s = module.spec
    if not (s.fp8 and s.fp8_scaling == "delayed"):
        return None
    return AmaxHistory((s.fp8_history, fp8.history_columns(n_weights)), name=fp8.HISTORY_PREFIX + name)()


def matmuls(
    spec: ModelSpec, x: jax.Array, specs, weights, out_dtype: str | None = None, block: bool = False, history=None
) -> tuple[jax.Array, ...]:
    """`jnp.einsum(s, x, w)` for each (s, w) in x's dtype with float32 accumulation; float32
    weights are cast to x's dtype for the product and get their gradients in float32. Quantized
    weights (QTensor) multiply through `qdot` (int8 x int8 on the CPU kernel path). `block`: a
    block's projection, an fp8 product when `spec.fp8` (the head and the rest never are), with
    the site's amax `history` (`fp8_history`) under delayed scaling."""
    if any(isinstance(w, QTensor) for w in weights):
        return tuple(qdot(s, x, w, out_dtype, int_dot=spec.cpu_kernels) for s, w in zip(specs, weights))
    if block and spec.fp8:
        return fp8.matmuls(x, specs, weights, out_dtype, history)
    if spec.cpu_kernels:
        return cpu_kernels.matmuls(x, specs, weights, out_dtype)
    out = jnp.dtype(out_dtype or x.dtype)
    return tuple(
        jnp.einsum(s, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out)
        for s, w in zip(specs, weights)
    )


def matmul(
    spec: ModelSpec, s: str, x: jax.Array, w: jax.Array, out_dtype: str | None = None, block: bool = False, history=None
) -> jax.Array:
    return matmuls(spec, x, [s], [w], out_dtype, block, history)[0]


def swiglu_down(spec: ModelSpec, gate: jax.Array, up: jax.Array, w: jax.Array, history=None) -> jax.Array:
    """(silu(gate) * up) @ w, the product in float32 rounded once to the compute dtype (a block's
    MLP: with `spec.fp8`, an fp8 product of the rounded hidden)."""
    if spec.fp8 and not isinstance(w, QTensor):
        h = (nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
        return fp8.matmul("btf,fd->btd", h, w, history=history)
    if spec.cpu_kernels and not isinstance(w, QTensor):
        return cpu_kernels.swiglu_down(gate, up, w)
    h = (nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
    return qdot("btf,fd->btd", h, w, int_dot=spec.cpu_kernels)


def scale_norm(spec: ModelSpec, x: jax.Array, scale: jax.Array) -> jax.Array:
    """x normalised over its last axis (RMSNorm, or LayerNorm's centring) times scale, in float32."""
    centered = spec.norm.kind == "layernorm"
    if spec.cpu_kernels:
        return cpu_kernels.scale_norm(x, scale, centered, spec.norm.eps)
    xf = x.astype(jnp.float32)
    if centered:
        xf = xf - xf.mean(-1, keepdims=True)
    return xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + spec.norm.eps) * scale


def normal(std: float):
    return nn.initializers.normal(stddev=std)


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last axis (d_model, or `dim`: a per-head q/k norm), computed in
    float32, returned in the compute dtype."""

    spec: ModelSpec
    dim: int = 0  # 0: d_model

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s, dim = self.spec, self.dim or self.spec.d_model
        scale = param(self, "scale", nn.initializers.ones, (dim,), ("norm",))
        y = scale_norm(s, x, scale)
        if s.norm.kind == "layernorm" and s.use_bias:
            y = y + param(self, "bias", nn.initializers.zeros, (dim,), ("norm",))
        return y.astype(s.dtype)


class Mlp(nn.Module):
    """SwiGLU or GeGLU (gate, up, down), or GELU (in, out) feed-forward."""

    spec: ModelSpec
    part: Partitioning

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s, dt = self.spec, self.spec.dtype
        init, out_init = normal(s.init_std), normal(s.init_std / (2 * s.n_layers) ** 0.5)
        names_in, names_out = ("embed", "mlp"), ("mlp", "embed")

        def dense_in(*names):
            ws = [param(self, n, init, (s.d_model, s.mlp.d_ff), names_in, quantized=True) for n in names]
            hs = matmuls(
                s, x, ["btd,df->btf"] * len(names), ws, block=True, history=fp8_history(self, "in", len(names))
            )
            hs = [
                h + lora_delta(self, s, n, x, "btd,df->btf", (s.d_model, s.mlp.d_ff), names_in) if targeted(s, n) else h
                for n, h in zip(names, hs)
            ]
            if s.use_bias:
                hs = [
                    h + param(self, n + "_bias", nn.initializers.zeros, (s.mlp.d_ff,), ("mlp",)).astype(dt)
                    for n, h in zip(names, hs)
                ]
            return [self.part.constrain(h, ("batch", "length", "act_mlp")) for h in hs]

        w_out = lambda: param(self, "w_down", out_init, (s.mlp.d_ff, s.d_model), names_out, quantized=True)
        if s.mlp.kind == "swiglu":
            gate, up = dense_in("w_gate", "w_up")
            y = swiglu_down(s, gate, up, w_out(), fp8_history(self, "down", 1))
            hidden = lambda: (nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dt)
        elif s.mlp.kind == "geglu":  # gelu (tanh approximation) gate, as Gemma's
            gate, up = dense_in("w_gate", "w_up")
            h = (nn.gelu(gate.astype(jnp.float32), approximate=True) * up.astype(jnp.float32)).astype(dt)
            y = matmul(s, "btf,fd->btd", h, w_out(), block=True, history=fp8_history(self, "down", 1))
            hidden = lambda: h
        else:
            h = nn.gelu(dense_in("w_in")[0], approximate=True)
            y = matmul(s, "btf,fd->btd", h, w_out(), block=True, history=fp8_history(self, "down", 1))
            hidden = lambda: h
        if targeted(s, "w_down"):
            y = y + lora_delta(self, s, "w_down", hidden(), "btf,fd->btd", (s.mlp.d_ff, s.d_model), names_out)
        if s.use_bias:
            y = y + param(self, "w_down_bias", nn.initializers.zeros, (s.d_model,), ("embed",)).astype(dt)
        return self.part.constrain(y, ("batch", "length", "act_embed"))
