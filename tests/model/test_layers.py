"""Norms and MLPs against numpy formulas, with non-trivial (random) params."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model.layers import Mlp, Norm, Partitioning
from tests.model.test_transformer import model_spec

SPEC = model_spec(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12, norm_eps=1e-5)


def apply(module, x, seed=0):
    """Runs the module with random params (so scale=1 / bias=0 defaults can't hide mistakes)."""
    abstract = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x))["params"]
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape), abstract)
    y = module.apply({"params": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)}, x)
    return np.asarray(y, np.float64), jax.tree.map(lambda a: np.asarray(a, np.float32).astype(np.float64), params)


@pytest.fixture(scope="module")
def x():
    return jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)) * 3 + 1, jnp.float32)


def test_rmsnorm(x):
    y, p = apply(Norm(SPEC), x)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * p["scale"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert set(p) == {"scale"}


@pytest.mark.parametrize("use_bias", [False, True])
def test_layernorm(x, use_bias):
    spec = SPEC.replace(norm=dict(kind="layernorm"), use_bias=use_bias)
    y, p = apply(Norm(spec), x)
    xn = np.asarray(x, np.float64)
    mu, var = xn.mean(-1, keepdims=True), xn.var(-1, keepdims=True)
    want = (xn - mu) / np.sqrt(var + 1e-5) * p["scale"] + (p["bias"] if use_bias else 0.0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert set(p) == ({"scale", "bias"} if use_bias else {"scale"})


def test_norm_returns_compute_dtype(x):
    spec = dataclasses.replace(SPEC, compute_dtype="bfloat16")
    y = Norm(spec).apply({"params": {"scale": jnp.ones(8)}}, x)
    assert y.dtype == jnp.bfloat16


def np_silu(a):
    return a / (1 + np.exp(-a))


def np_gelu_tanh(a):
    return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))


def test_swiglu_mlp(x):
    y, p = apply(Mlp(SPEC, Partitioning()), x, seed=1)
    xn = np.asarray(x, np.float64)
    want = (np_silu(xn @ p["w_gate"]) * (xn @ p["w_up"])) @ p["w_down"]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_gelu_mlp_with_bias(x):
    spec = SPEC.replace(mlp=dict(kind="gelu"), use_bias=True)
    y, p = apply(Mlp(spec, Partitioning()), x, seed=2)
    xn = np.asarray(x, np.float64)
    h = np_gelu_tanh(xn @ p["w_in"] + p["w_in_bias"])
    want = h @ p["w_down"] + p["w_down_bias"]
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "spec, a_shape, b_shape",
    [
        ("btd,df->btf", (2, 3, 4), (4, 5)),
        ("btd,dnh->btnh", (2, 3, 4), (4, 2, 3)),
        ("btnh,nhd->btd", (2, 3, 2, 3), (2, 3, 4)),
    ],
)
def test_matmul_value_and_grads_match_einsum(spec, a_shape, b_shape):
    from lm.model.cpu_kernels import matmul

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=a_shape), jnp.float32)
    b = jnp.asarray(rng.normal(size=b_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=jnp.einsum(spec, a, b).shape), jnp.float32)  # a non-uniform cotangent

    def ours(a, b):
        return jnp.sum(matmul(spec, a, b) * w)

    def reference(a, b):
        return jnp.sum(jnp.einsum(spec, a, b) * w)

    # a sum of products: its rounding scales with the sum of their magnitudes, not with the sum
    np.testing.assert_allclose(
        ours(a, b), reference(a, b), rtol=0, atol=1e-6 * float(jnp.sum(jnp.abs(jnp.einsum(spec, a, b) * w)))
    )
    for g, r in zip(jax.grad(ours, (0, 1))(a, b), jax.grad(reference, (0, 1))(a, b)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    bf16 = matmul(spec, a.astype(jnp.bfloat16), b)  # a float32 weight is cast to the activation's dtype
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        bf16.astype(jnp.float32),
        jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32),
        rtol=1e-2,
        atol=1e-2,
    )
    assert matmul(spec, a.astype(jnp.bfloat16), b, out_dtype="float32").dtype == jnp.float32


def test_matmuls_share_the_activation_and_sum_its_gradients():
    from lm.model.cpu_kernels import matmuls

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.float32), jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)]
    specs = ["btd,dnh->btnh", "btd,df->btf"]
    cots = [jnp.asarray(rng.normal(size=jnp.einsum(s, x, w).shape), jnp.float32) for s, w in zip(specs, ws)]

    def loss(products):
        return lambda x, ws: sum(jnp.sum(y * c) for y, c in zip(products(x, ws), cots))

    ours = loss(lambda x, ws: matmuls(x, specs, ws))
    reference = loss(lambda x, ws: [jnp.einsum(s, x, w) for s, w in zip(specs, ws)])
    magnitude = sum(float(jnp.sum(jnp.abs(jnp.einsum(s, x, w) * c))) for s, w, c in zip(specs, ws, cots))
    np.testing.assert_allclose(ours(x, ws), reference(x, ws), rtol=0, atol=1e-6 * magnitude)  # a sum of products
    got, want = jax.grad(ours, (0, 1))(x, ws), jax.grad(reference, (0, 1))(x, ws)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="share the activation"):
        matmuls(x, ["btd,df->btf", "bsd,df->bsf"], [ws[1], ws[1]])


def test_float32_weight_gradient_is_not_rounded_to_the_compute_dtype():
    """With bfloat16 activations the weight gradient is accumulated and returned in float32."""
    from lm.model.cpu_kernels import matmul

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(4, 64, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(4, 64, 8)), jnp.bfloat16)
    dw = jax.grad(lambda w: jnp.sum((matmul("btd,df->btf", x, w) * cot).astype(jnp.float32)))(w)
    want = np.einsum("btd,btf->df", np.asarray(x, np.float64), np.asarray(cot, np.float64))
    assert dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-4)  # bfloat16 rounding would be ~1e-2
    assert np.abs(np.asarray(dw) - np.asarray(dw.astype(jnp.bfloat16), np.float32)).max() > 1e-3


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scale_norm_value_and_grads_match_autodiff(centered, dtype):
    from lm.model.cpu_kernels import scale_norm

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 3, 8)) * 3 + 1, dtype)
    scale = jnp.asarray(1 + 0.3 * rng.normal(size=(8,)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)

    def reference(x, scale):
        xf = x.astype(jnp.float32)
        if centered:
            xf = xf - xf.mean(-1, keepdims=True)
        return jnp.sum(xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * scale * cot)

    ours = lambda x, scale: jnp.sum(scale_norm(x, scale, centered, 1e-5) * cot)
    np.testing.assert_allclose(ours(x, scale), reference(x, scale), rtol=1e-5)
    got, want = jax.grad(ours, (0, 1))(x, scale), jax.grad(reference, (0, 1))(x, scale)
    assert got[0].dtype == x.dtype and got[1].dtype == jnp.float32
    tol = 1e-5 if dtype == "float32" else 1e-2
    for g, r in zip(got, want):
        assert float(jnp.abs(r.astype(jnp.float32)).max()) > 1e-2
        np.testing.assert_allclose(g.astype(jnp.float32), r.astype(jnp.float32), rtol=tol, atol=tol)


def test_stash_round_trips_16_bit_floats_through_uint16_bits():
    from lm.model.stash import stash, unstash

    x = jnp.asarray(np.random.default_rng(6).normal(size=(3, 5)), jnp.bfloat16)
    bits = stash(x)
    assert bits.dtype == jnp.uint16 and bits.shape == x.shape
    assert bool(jnp.all(unstash(bits, jnp.bfloat16) == x))
    f = jnp.ones(3, jnp.float32)
    assert stash(f) is f and unstash(f, jnp.float32) is f


def test_swiglu_down_value_and_grads_match_autodiff():
    """The hand-written backward (which recomputes silu(gate) * up) against autodiff."""
    from lm.model.cpu_kernels import swiglu_down

    rng = np.random.default_rng(1)
    gate, up = (jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    reference = lambda g, u, w: jnp.sum(jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, w) * cot)
    ours = lambda g, u, w: jnp.sum(swiglu_down(g, u, w) * cot)
    magnitude = float(jnp.sum(jnp.abs(jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w) * cot)))
    np.testing.assert_allclose(ours(gate, up, w), reference(gate, up, w), rtol=0, atol=1e-6 * magnitude)
    for got, want in zip(jax.grad(ours, (0, 1, 2))(gate, up, w), jax.grad(reference, (0, 1, 2))(gate, up, w)):
        assert float(jnp.abs(want).max()) > 1e-2
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a_shape, g_shape", [((2, 3, 8), (2, 3, 5)), ((2, 3, 5), (2, 3, 8))])
def test_weight_grad_either_operand_order(a_shape, g_shape):
    """Whichever operand is narrower goes first; the result is the same contraction."""
    from lm.model.cpu_kernels import _weight_grad

    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=a_shape), jnp.float32)
    g = jnp.asarray(rng.normal(size=g_shape), jnp.float32)
    got = jax.jit(lambda a, g: _weight_grad("btf", a, "btd", g, "fd", jnp.float32))(a, g)
    np.testing.assert_allclose(got, jnp.einsum("btf,btd->fd", a, g), rtol=1e-5, atol=1e-6)
