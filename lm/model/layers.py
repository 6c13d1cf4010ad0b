"""Building blocks: logically-partitioned params, norms, MLPs, sharding constraints."""

from __future__ import annotations

import dataclasses
import functools

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
    attention: str = "xla"
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


@functools.lru_cache(maxsize=None)
def _matmul_fn(spec: str, out_dtype: str | None):
    """An einsum of two operands with float32 accumulation and an explicit backward pass.

    Autodiff of a multi-axis einsum leaves XLA dot_generals with transposed layouts that
    the CPU backend runs through slow copies and upcasts; spelling the two gradient
    einsums out (same accumulation) keeps every product on the fast matmul path.
    """
    inputs, out = spec.split("->")
    a_spec, b_spec = inputs.split(",")

    def product(s, a, b, dtype):
        return jnp.einsum(s, a, b, preferred_element_type=jnp.float32).astype(dtype)

    @jax.custom_vjp
    def matmul(a, b):
        return product(spec, a, b, out_dtype or a.dtype)

    def forward(a, b):
        return matmul(a, b), (a, b)

    def backward(saved, g):
        a, b = saved
        return (product(f"{out},{b_spec}->{a_spec}", g, b, a.dtype),
                product(f"{a_spec},{out}->{b_spec}", a, g, b.dtype))

    matmul.defvjp(forward, backward)
    return matmul


def matmul(spec: str, a: jax.Array, b: jax.Array, out_dtype: str | None = None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` with float32 accumulation, returned in out_dtype (default a's)."""
    return _matmul_fn(spec.replace(" ", ""), out_dtype)(a, b)


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
            h = nn.silu(dense_in("w_gate")) * dense_in("w_up")
        else:
            h = nn.gelu(dense_in("w_in"), approximate=True)
        w_out = param(self, "w_down", out_init, (s.d_ff, s.d_model), names_out)
        y = matmul("btf,fd->btd", h, w_out.astype(dt))
        if s.use_bias:
            y = y + param(self, "w_down_bias", nn.initializers.zeros, (s.d_model,), ("embed",)).astype(dt)
        return self.part.constrain(y, ("batch", "length", "act_embed"))
