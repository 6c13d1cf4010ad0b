"""The two kernel paths (plain einsum + autodiff, and lm.model.cpu_kernels) give the same loss
and gradients for whole models: float32 tightly, bfloat16 within its precision."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.model.transformer import Transformer
from tests.model.test_transformer import TINY, random_params

MODELS = {
    "llama": TINY,
    "gpt2": TINY.replace(
        mlp=dict(kind="gelu"), norm=dict(kind="layernorm"), use_bias=True, position="learned", tie_embeddings=False
    ),
}


def loss_and_grads(spec, params, tokens):
    model = Transformer(spec)

    def loss(p):
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = model.apply({"params": p}, x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5), ("bfloat16", 3e-2)])
def test_plain_and_cpu_kernels_agree(name, dtype, tol):
    base = MODELS[name].replace(compute_dtype=dtype, attention=dict(kernel="reference"))
    params = random_params(Transformer(base), seed=0)
    tokens = jax.random.randint(jax.random.key(2), (2, 14), 0, base.vocab_size)
    loss_cpu, g_cpu = loss_and_grads(dataclasses.replace(base, kernels="cpu"), params, tokens)
    loss_plain, g_plain = loss_and_grads(dataclasses.replace(base, kernels="plain"), params, tokens)
    np.testing.assert_allclose(loss_plain, loss_cpu, rtol=tol / 10)
    largest = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g_cpu))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_cpu), jax.tree.leaves(g_plain)):
        if path[-1].key == "wk_bias":  # zero in exact arithmetic: softmax ignores a constant per query
            assert float(jnp.abs(a).max()) < tol * largest and float(jnp.abs(b).max()) < tol * largest
            continue
        scale = max(float(jnp.abs(a).max()), 1e-2 * largest)  # per leaf, relative to its own size
        np.testing.assert_allclose(b, a, rtol=0, atol=tol * scale, err_msg=jax.tree_util.keystr(path))


def test_auto_picks_cpu_kernels_on_cpu():
    assert jax.default_backend() == "cpu"
    assert dataclasses.replace(TINY, kernels="auto").cpu_kernels
    assert not dataclasses.replace(TINY, kernels="plain").cpu_kernels
