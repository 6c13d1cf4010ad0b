"""The fused kernels (splash for TPU, Pallas flash for GPU) in Pallas's interpreter on CPU, against
the reference attention: outputs and gradients on packed rows with padding, grouped kv heads,
sliding windows and the soft cap; no document sees another; through the model on a 2x2x2 mesh
equal to one device; and what model.attention="auto" picks per backend."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config, rules_table
from lm.model import fused_attention as fused
from lm.model.attention import attend, reference_attention, segment_causal_mask
from lm.model.build import build_model
from lm.model.layers import Partitioning
from lm.model.transformer import init_params

B, T, N, K, H = 2, 256, 4, 2, 32


def segments() -> np.ndarray:
    seg = np.ones((B, T), np.int32)
    seg[:, 100:] = 2
    seg[0, 170:] = 3
    seg[1, 200:] = 0  # padding
    return seg


def qkv(seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))


def value_and_grads(fn, q, k, v):
    loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))  # noqa: E731
    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


CASES = [
    ("splash", None, 0.0, 0.0),
    ("splash", 48, 0.0, 0.0),  # a local layer: 48 keys, the query's own included
    ("splash", None, 20.0, 0.1),  # Gemma 2's soft cap over scaled logits
    ("flash", None, 0.0, 0.0),
    ("flash", None, 0.0, 0.25),
]


@pytest.mark.parametrize("kernel,window,cap,scale", CASES)
def test_kernel_equals_the_reference_in_values_and_gradients(kernel, window, cap, scale):
    seg = jnp.asarray(segments())
    q, k, v = qkv()
    got, got_g = value_and_grads(
        lambda q, k, v: fused.fused_attention(kernel, q, k, v, seg, Partitioning(), scale, cap, window), q, k, v
    )
    want, want_g = value_and_grads(
        lambda q, k, v: reference_attention(q, k, v, segment_causal_mask(seg, window), scale, cap), q, k, v
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))), err_msg=name)


@pytest.mark.parametrize("kernel", ["splash", "flash"])
def test_changing_one_document_changes_nothing_in_the_others(kernel):
    seg = segments()
    q, k, v = qkv()
    doc2 = jnp.asarray(seg == 2)[..., None, None]
    changed = [jnp.where(doc2, y * 3 + 1, x) for x, y in zip((q, k, v), qkv(1))]  # document 2's tokens only
    run = jax.jit(
        lambda q, k, v: fused.fused_attention(kernel, q, k, v, jnp.asarray(seg), Partitioning(), 0.0, 0.0, None)
    )
    a, b = np.asarray(run(q, k, v)), np.asarray(run(*changed))
    np.testing.assert_array_equal(a[seg != 2], b[seg != 2])
    assert np.abs(a[seg == 2] - b[seg == 2]).max() > 0.1


def test_lengths_and_layers_a_kernel_does_not_take_run_blockwise():
    assert fused.takes("splash", 256, 48, 50.0) and fused.takes("flash", 384, None, 0.0)
    assert not fused.takes("splash", 200, None, 0.0)  # not a multiple of the 128-token tile
    assert not fused.takes("flash", 256, 48, 0.0) and not fused.takes("flash", 256, None, 30.0)
    seg = jnp.asarray(np.ones((1, 40), np.int32))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 40, n, 8)), jnp.float32) for n in (4, 2, 2))
    want = reference_attention(q, k, v, segment_causal_mask(seg))
    np.testing.assert_allclose(attend(q, k, v, seg, "splash"), want, rtol=1e-5, atol=1e-6)
    # a pipeline's stage (mesh.stage > 1) runs under vmap, where the kernels' shard_map cannot go
    stages = Partitioning(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",)), ())
    for t in (40, 256):
        seg, q, k, v = seg[:, :1].repeat(t, 1), *(jnp.tile(x[:, :1], (1, t, 1, 1)) for x in (q, k, v))
        want = reference_attention(q, k, v, segment_causal_mask(seg))
        np.testing.assert_allclose(attend(q, k, v, seg, "auto", part=stages), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(attend(q, k, v, seg, "flash", part=stages), want, rtol=1e-5, atol=1e-6)


def test_auto_is_the_backends_kernel(monkeypatch):
    part = Partitioning()
    assert fused.resolve("auto", part) == "blockwise"  # this CPU
    for backend, kernel in (("tpu", "splash"), ("gpu", "flash"), ("cpu", "blockwise")):
        monkeypatch.setattr(fused, "platform", lambda _, b=backend: b)
        assert fused.resolve("auto", part) == kernel and fused.resolve("xla", part) == "xla"


def model_config(kernel: str, **model):
    c = base_config()
    c.model.update(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=T, init_std=0.2)
    c.model.update(attention=kernel, **model)
    c.data.seq_len = T
    return c


def loss_and_grads(config, devices, params=None, mesh=None):
    if mesh:
        config.mesh.update(mesh)
    built = build_model(config, devices, rules=rules_table(config))
    params = params if params is not None else nn.unbox(init_params(built.module, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, 64, (4, T + 1)), jnp.int32)
    seg = jnp.asarray(np.concatenate([segments(), segments()]))
    pos = jnp.asarray(np.tile(np.arange(T), (4, 1)), jnp.int32)

    def loss(p):
        logits = built.module.apply({"params": p}, tokens[:, :-1], seg, pos)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(ce * (seg > 0)) / jnp.sum(seg > 0)

    placed = built.place(params) if mesh else params
    return params, jax.jit(jax.value_and_grad(loss))(placed)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("kernel", ["splash", "flash"])
def test_the_model_on_a_mesh_with_a_fused_kernel_equals_blockwise_on_one_device(kernel):
    params, (want, want_g) = loss_and_grads(model_config("blockwise"), jax.devices()[:1])
    _, (got, got_g) = loss_and_grads(model_config(kernel), jax.devices(), params, dict(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), jax.device_get(got_g), want_g)


def test_local_layers_with_splash_equal_the_reference():
    """Gemma-style alternating local (window 48) and global layers with a soft cap: each layer picks
    its kernel at run time from its traced flag."""
    local = dict(sliding_window=48, layer_types=("local", "global"), attn_softcap=30.0)
    params, (want, want_g) = loss_and_grads(model_config("reference", **local), jax.devices()[:1])
    _, (got, got_g) = loss_and_grads(model_config("splash", **local), jax.devices()[:1], params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got_g, want_g)
