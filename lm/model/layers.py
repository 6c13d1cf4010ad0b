"""Building blocks: logically-partitioned params, norms, MLPs, sharding constraints."""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model's hyperparameters as a hashable value (built from config.model)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    use_bias: bool = False
    position: str = "rope"
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    compute_dtype: str = "float32"
    attention: str = "blockwise"
    remat: str = "none"
    init_std: float = 0.02

    @classmethod
    def from_config(cls, m) -> "ModelSpec":
        fields = {f.name: m[f.name] for f in dataclasses.fields(cls)}
        fields["head_dim"] = m.head_dim or m.d_model // m.n_heads
        return cls(**fields)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)


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
def _matmul_fn(spec: str, out_dtype: str | None):
    """An einsum of two operands with float32 accumulation and an explicit backward pass.

    Autodiff of a multi-axis einsum leaves XLA dot_generals with transposed layouts that
    the CPU backend runs through slow copies and upcasts; spelling the two gradient
    einsums out (same accumulation) keeps every product on the fast matmul path.
    """
    inputs, out = spec.split("->")
    a_spec, b_spec = inputs.split(",")

    @jax.custom_vjp
    def matmul(a, b):
        return _product(spec, a, b, out_dtype or a.dtype)

    def forward(a, b):
        return matmul(a, b), (a, b)

    def backward(saved, g):
        a, b = saved
        return (_product(f"{out},{b_spec}->{a_spec}", g, b, a.dtype),
                _weight_grad(a_spec, a, out, g, b_spec, b.dtype))

    matmul.defvjp(forward, backward)
    return matmul


def matmul(spec: str, a: jax.Array, b: jax.Array, out_dtype: str | None = None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` with float32 accumulation, returned in out_dtype (default a's)."""
    return _matmul_fn(spec.replace(" ", ""), out_dtype)(a, b)


@jax.custom_vjp
def swiglu_down(gate: jax.Array, up: jax.Array, w: jax.Array) -> jax.Array:
    """(silu(gate) * up) @ w for [B, T, F] activations and a [F, D] weight.

    The backward pass recomputes silu(gate) * up from the saved gate and up rather than
    keeping a third [B, T, F] activation per layer until the backward pass.
    """
    return _product("btf,fd->btd", _swiglu(gate, up).astype(gate.dtype), w, gate.dtype)


def _swiglu(gate, up):
    """silu(gate) * up in float32 (one rounding to the compute dtype, by the caller)."""
    return nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def _swiglu_down_fwd(gate, up, w):
    return swiglu_down(gate, up, w), (gate, up, w)


def _swiglu_down_bwd(saved, g):
    gate, up, w = saved
    gf, uf = gate.astype(jnp.float32), up.astype(jnp.float32)
    sig = jax.nn.sigmoid(gf)
    silu = gf * sig
    dh = _product("btd,fd->btf", g, w, jnp.float32)
    d_gate = dh * uf * sig * (1 + gf * (1 - sig))
    d_w = _weight_grad("btf", _swiglu(gate, up).astype(gate.dtype), "btd", g, "fd", w.dtype)
    return d_gate.astype(gate.dtype), (dh * silu).astype(up.dtype), d_w


swiglu_down.defvjp(_swiglu_down_fwd, _swiglu_down_bwd)


def param(module: nn.Module, name: str, init, shape, names) -> jax.Array:
    """A float32 param annotated with logical axis names."""
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def normal(std: float):
    return nn.initializers.normal(stddev=std)


class Norm(nn.Module):
    """RMSNorm or LayerNorm, computed in float32, returned in the compute dtype."""

    spec: ModelSpec

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.spec
        scale = param(self, "scale", nn.initializers.ones, (s.d_model,), ("norm",))
        xf = x.astype(jnp.float32)
        if s.norm == "layernorm":
            xf = xf - xf.mean(-1, keepdims=True)
        y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + s.norm_eps) * scale
        if s.norm == "layernorm" and s.use_bias:
            y = y + param(self, "bias", nn.initializers.zeros, (s.d_model,), ("norm",))
        return y.astype(s.dtype)


class Mlp(nn.Module):
    """SwiGLU (gate, up, down) or GELU (in, out) feed-forward."""

    spec: ModelSpec
    part: Partitioning

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s, dt = self.spec, self.spec.dtype
        init, out_init = normal(s.init_std), normal(s.init_std / (2 * s.n_layers) ** 0.5)
        names_in, names_out = ("embed", "mlp"), ("mlp", "embed")

        def dense_in(name):
            w = param(self, name, init, (s.d_model, s.d_ff), names_in)
            h = matmul("btd,df->btf", x, w.astype(dt))
            if s.use_bias:
                h = h + param(self, name + "_bias", nn.initializers.zeros, (s.d_ff,), ("mlp",)).astype(dt)
            return self.part.constrain(h, ("batch", "length", "act_mlp"))

        if s.mlp == "swiglu":
            gate, up = dense_in("w_gate"), dense_in("w_up")
            w_out = param(self, "w_down", out_init, (s.d_ff, s.d_model), names_out)
            y = swiglu_down(gate, up, w_out.astype(dt))
        else:
            h = nn.gelu(dense_in("w_in"), approximate=True)
            w_out = param(self, "w_down", out_init, (s.d_ff, s.d_model), names_out)
            y = matmul("btf,fd->btd", h, w_out.astype(dt))
        if s.use_bias:
            y = y + param(self, "w_down_bias", nn.initializers.zeros, (s.d_model,), ("embed",)).astype(dt)
        return self.part.constrain(y, ("batch", "length", "act_embed"))
