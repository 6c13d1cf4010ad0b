"""FP8 products (lm.model.fp8, `model.fp8`): the forward and both gradients against a hand
computation in numpy (ml_dtypes' float8 casts, float32 products, rescaled), an all-zero tensor
and a huge outlier, the model's params unchanged by the flag, fp8 operands in the blocks' dots
(and not in the head's), and the TPU compiler keeping them fp8 (ahead of time, with libtpu)."""

import importlib.util
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm.config import base_config
from lm.model import fp8
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params


def by_hand(x, dtype):
    """(values as float32 after the fp8 rounding, scale): scale = amax / dtype's max, each
    division a product with the float32 reciprocal (as lm.model.fp8 spells it)."""
    x = np.asarray(x, np.float32)
    top = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.abs(x).max()
    scale = amax * np.float32(1 / top) if amax > 0 else np.float32(1)
    q = np.clip(x * (np.float32(1) / scale), -top, top).astype(dtype)
    return q.astype(np.float32), scale


E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def hand_product(spec, x, w):
    xq, sx = by_hand(x, E4M3)
    wq, sw = by_hand(w, E4M3)
    return np.einsum(spec, xq, wq) * (sx * sw)


def hand_grads(spec, x, w, g):
    """(dx, dw) from the e4m3 operands and the e5m2-rounded gradient, each rescaled."""
    ins, out = spec.split("->")
    xl, wl = ins.split(",")
    xq, sx = by_hand(x, E4M3)
    wq, sw = by_hand(w, E4M3)
    gq, sg = by_hand(g, E5M2)
    return np.einsum(f"{out},{wl}->{xl}", gq, wq) * (sg * sw), np.einsum(f"{xl},{out}->{wl}", xq, gq) * (sx * sg)


def rand(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


SPECS = [("btd,df->btf", (2, 5, 16), (16, 24)), ("btnh,nhd->btd", (2, 5, 4, 8), (4, 8, 16))]


def close(a, b):
    """Equal to float32 rounding: the same products summed in another order."""
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max() + 1e-30))


def test_quantize_rounds_exactly_as_ml_dtypes():
    x = rand(0, (64, 32), 3.0)
    for dtype, ml in ((fp8.E4M3, E4M3), (fp8.E5M2, E5M2)):
        q, s, _ = jax.jit(lambda v, d=dtype: fp8.quantize(v, d))(x)
        want, ws = by_hand(x, ml)
        assert q.dtype == dtype and float(s) == ws
        np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want)
        assert float(jnp.abs(q.astype(jnp.float32)).max()) == float(ml_dtypes.finfo(ml).max)  # amax lands on the top


@pytest.mark.parametrize("spec,xs,ws", SPECS)
def test_forward_and_gradients_are_the_hand_computation(spec, xs, ws):
    x, w, g = rand(1, xs), rand(2, ws, 0.05), rand(3, xs[:2] + (ws[-1],), 1e-3)
    y, vjp = jax.vjp(lambda a, b: fp8.matmul(spec, a, b), jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == jnp.float32
    close(y, hand_product(spec, x, w))
    dx, dw = vjp(jnp.asarray(g))
    want_dx, want_dw = hand_grads(spec, x, w, g)
    close(dx, want_dx)
    close(dw, want_dw)
    # and not the plain product's: the roundings are there
    assert not np.allclose(np.asarray(y), np.einsum(spec, x, w), rtol=1e-4, atol=0)


def test_products_sharing_an_activation_sum_their_gradients_and_keep_dtypes():
    x, ws = rand(4, (2, 6, 16)), [rand(5 + i, (16, 8), 0.1) for i in range(3)]
    gs = [rand(9 + i, (2, 6, 8)) for i in range(3)]
    xb = jnp.asarray(x, jnp.bfloat16)
    ys, vjp = jax.vjp(lambda a, b: fp8.matmuls(a, ["btd,df->btf"] * 3, b), xb, tuple(map(jnp.asarray, ws)))
    assert all(y.dtype == jnp.bfloat16 for y in ys)
    dx, dws = vjp(tuple(jnp.asarray(g, jnp.bfloat16) for g in gs))
    assert dx.dtype == jnp.bfloat16 and all(d.dtype == jnp.float32 for d in dws)
    xf = np.asarray(xb.astype(jnp.float32))
    parts = [
        hand_grads("btd,df->btf", xf, w, np.asarray(jnp.asarray(g, jnp.bfloat16).astype(jnp.float32)))
        for w, g in zip(ws, gs)
    ]
    np.testing.assert_allclose(np.asarray(dx.astype(jnp.float32)), sum(p[0] for p in parts), rtol=1e-2, atol=1e-3)
    for d, p in zip(dws, parts):
        close(d, p[1])


def test_an_all_zero_tensor_gives_zeros_not_nan():
    x, w = np.zeros((2, 3, 8), np.float32), rand(6, (8, 4))
    y, vjp = jax.vjp(lambda a, b: fp8.matmul("btd,df->btf", a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.ones_like(y))
    for a in (y, dx, dw):
        assert np.isfinite(np.asarray(a)).all()
    assert not np.asarray(y).any() and not np.asarray(dw).any()
    _, vjp = jax.vjp(lambda a, b: fp8.matmul("btd,df->btf", a, b), jnp.asarray(rand(7, (2, 3, 8))), jnp.asarray(w))
    dx, dw = vjp(jnp.zeros((2, 3, 4)))  # a zero gradient
    assert not np.asarray(dx).any() and not np.asarray(dw).any() and np.isfinite(np.asarray(dx)).all()


def test_a_huge_outlier_sets_the_scale_without_overflow():
    x = rand(8, (2, 4, 32))
    x[1, 2, 5] = 3e6  # far above e4m3's 448: the scale brings it to 448, the rest towards (or to) zero
    w = rand(9, (32, 16))
    g = rand(10, (2, 4, 16))
    g[0, 0, 0] = -1e9
    y, vjp = jax.vjp(lambda a, b: fp8.matmul("btd,df->btf", a, b), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    for a in (y, dx, dw):
        assert np.isfinite(np.asarray(a)).all()
    close(y, hand_product("btd,df->btf", x, w))
    want_dx, want_dw = hand_grads("btd,df->btf", x, w, g)
    close(dx, want_dx)
    close(dw, want_dw)
    q, s, _ = fp8.quantize(jnp.asarray(x), fp8.E4M3)
    assert float(q[1, 2, 5].astype(jnp.float32) * s) == pytest.approx(3e6, rel=1e-6)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices (tests/conftest.py)")
def test_a_product_on_a_2x2x2_mesh_equals_one_device():
    """The amax of a sharded tensor is the whole tensor's (one scale, not one a shard)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    x, w, g = rand(11, (8, 4, 32)), rand(12, (32, 16), 0.1), rand(13, (8, 4, 16))
    x[5, 1, 3] = 40.0  # the largest values sit on different shards
    w[30, 2] = -3.0
    places = [P(("data", "fsdp")), P("fsdp", "tensor"), P(("data", "fsdp"), None, "tensor")]

    def f(a, b, c):
        y, vjp = jax.vjp(lambda a, b: fp8.matmul("btd,df->btf", a, b), a, b)
        return (y, *vjp(c))

    one = jax.jit(f)(x, w, g)
    sharded = [jax.device_put(v, NamedSharding(mesh, p)) for v, p in zip((x, w, g), places)]
    eight = jax.jit(f)(*sharded)
    assert len(eight[0].sharding.device_set) == 8
    for a, b in zip(one, eight):
        close(b, np.asarray(a))


# ---- in the model ------------------------------------------------------------------------------


def spec(**keys) -> ModelSpec:
    m = base_config().model
    m.update(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    m.update(keys)
    return ModelSpec.from_config(m)


def abstract(s: ModelSpec):
    model = Transformer(s)
    return jax.eval_shape(lambda k: init_params(model, k), jax.random.key(0))


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_the_params_are_the_same_with_and_without_fp8(mlp):
    plain, f8 = abstract(spec(mlp=mlp)), abstract(spec(mlp=mlp, fp8=True))
    assert jax.tree.structure(plain) == jax.tree.structure(f8)
    same = lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype)  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(same, nn.unbox(plain), nn.unbox(f8))))
    names = lambda t: [x.names for x in jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, nn.Partitioned))]  # noqa: E731
    assert names(plain) == names(f8)  # the same logical axes: the same shardings


def dots(hlo: str) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in a StableHLO module's text."""
    out = []
    for line in hlo.splitlines():
        if "stablehlo.dot_general" in line:
            operands = re.search(r":\s*\((.*)\)\s*->", line).group(1)
            out.append(tuple(re.findall(r"x(f8E4M3FN|f8E5M2|bf16|f32)>", operands)))
    return out


def lowered_grad(s: ModelSpec) -> list:
    """The dots of the gradient of a forward pass of model s (StableHLO, before any compiler)."""
    model = Transformer(s)
    ids = jnp.zeros((2, 8), jnp.int32)

    def loss(p):
        return model.apply({"params": p}, ids, jnp.ones_like(ids), ids).astype(jnp.float32).sum()

    return dots(jax.jit(jax.grad(loss)).lower(nn.unbox(abstract(s))).as_text())


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_blocks_dots_take_fp8_operands_and_the_head_does_not(compute_dtype):
    found = lowered_grad(spec(fp8=True, compute_dtype=compute_dtype))
    fwd = [d for d in found if d == ("f8E4M3FN", "f8E4M3FN")]
    bwd = [d for d in found if sorted(d) == ["f8E4M3FN", "f8E5M2"]]
    # q, k, v, o, gate, up, down: once in the scanned body; each has two gradient products
    assert len(fwd) == 7 and len(bwd) == 14, found
    plain = lowered_grad(spec(compute_dtype=compute_dtype))
    assert not any("f8" in "".join(d) for d in plain)
    # what stays: attention's two products and the head (forward and its two gradients)
    assert len(found) - 21 == len(plain) - 21 > 0, (found, plain)


def test_fp8_forward_is_close_to_the_plain_model():
    plain, f8 = spec(init_std=0.1), spec(init_std=0.1, fp8=True)
    model = Transformer(plain)
    params = nn.unbox(jax.jit(lambda k: init_params(model, k))(jax.random.key(0)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    run = lambda s: Transformer(s).apply({"params": params}, ids, jnp.ones_like(ids), ids)  # noqa: E731
    a, b = np.asarray(run(plain)), np.asarray(run(f8))
    assert not np.array_equal(a, b)
    rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
    # measured 0.058; one product of normal operands is ~0.039 off (e4m3 keeps 3 mantissa bits)
    assert rel < 0.1, rel


# ---- the TPU compiler, ahead of time ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs lm[tpu] (libtpu)")
def test_the_tpu_compiler_keeps_the_blocks_dots_in_fp8():
    """A v5p-8 train step (lm.plan.aot): every block product's convolution takes f8e4m3fn operands
    forward and an f8e5m2 gradient backward, and the head's takes none."""
    from lm.config import load_config
    from lm.plan.aot import compile_step, target_devices
    from lm.plan.hardware import parse_target

    keys = dict(vocab_size=256, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256, max_seq_len=128)
    overrides = [f"model.{k}={v}" for k, v in keys.items()]
    overrides += ["model.fp8=true", "model.compute_dtype=bfloat16", "model.attention=xla", "model.kernels=plain"]
    overrides += ["data.seq_len=128", "train.batch_size=8", "mesh.data=-1"]
    compiled = compile_step(
        "pretrain", load_config("configs/tiny.py", overrides), target_devices(parse_target("v5p-8"))
    )
    assert compiled.error is None, compiled.error
    hlo = compiled.compiled.as_text()
    dtype = dict(re.findall(r"%(\S+) = (\w+)\[", hlo))
    convs = []
    for line in hlo.splitlines():
        m = re.search(r" (?:convolution|dot)\(%([^,\s]+), %([^,\s)]+)\)", line)
        if m:
            convs.append((re.search(r'op_name="([^"]*)"', line).group(1), dtype[m.group(1)], dtype[m.group(2)]))
    f8 = {(name.rsplit("/", 2)[-2], tuple(sorted(ts))) for name, *ts in convs if ts[0].startswith("f8")}
    for s in ("btd,dnh->btnh", "btnh,nhd->btd", "btd,df->btf", "btf,fd->btd"):
        assert (s, ("f8e4m3fn", "f8e4m3fn")) in f8, (s, f8)
    assert sum(1 for _, t in f8 if t == ("f8e4m3fn", "f8e5m2")) >= 6, f8  # both gradients of each
    assert not [c for c in convs if "_heads" in c[0] and "f8" in c[1] + c[2]]
