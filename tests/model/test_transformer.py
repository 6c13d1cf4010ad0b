"""Whole-model behaviour: packed-document isolation, remat equivalence, bf16, initial loss."""

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.config import base_config
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params


def model_spec(**keys) -> ModelSpec:
    """The config's default model with these model-section keys changed (ModelSpec holds no defaults)."""
    m = base_config().model
    m.update(keys)
    return ModelSpec.from_config(m)


# init_std larger than the default so attention patterns (and any leak) are clearly visible.
TINY = model_spec(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16, init_std=0.2
)


def random_params(model: Transformer, seed: int):
    """Params of the model's shapes filled by numpy (compiling the threefry init is slow on CPU):
    norm scales 1 + noise, everything else N(0, init_std)."""
    abstract = nn.unbox(jax.eval_shape(lambda k: init_params(model, k), jax.random.key(0)))
    rng, std = np.random.default_rng(seed), model.spec.init_std
    fill = lambda path, x: jnp.asarray(
        (1 + 0.1 * rng.normal(size=x.shape)) if path[-1].key == "scale" else std * rng.normal(size=x.shape), jnp.float32
    )
    return jax.tree_util.tree_map_with_path(fill, abstract)


@functools.cache
def make(spec: ModelSpec, seed: int = 0, real_init: bool = False):
    """(model, unboxed params, jitted forward), built once per spec (compiles are the slow part)."""
    model = Transformer(spec)
    if real_init:
        params = nn.unbox(jax.jit(lambda k: init_params(model, k))(jax.random.key(seed)))
    else:
        params = random_params(model, seed)
    return model, params, jax.jit(lambda p, x, s, pos: model.apply({"params": p}, x, s, pos))


# ---- packing isolation --------------------------------------------------------------------

DOC1, DOC2 = [5, 9, 13], [7, 22, 3, 40]


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_packed_documents_do_not_see_each_other(position):
    _, params, fwd = make(dataclasses.replace(TINY, position=position))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 0, 1, 2, 3]], jnp.int32)

    packed = fwd(params, jnp.array([DOC1 + DOC2], jnp.int32), seg, pos)
    alone = fwd(params, jnp.array([DOC2], jnp.int32), jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None])
    np.testing.assert_allclose(packed[0, 3:], alone[0], atol=1e-5)

    other = fwd(params, jnp.array([[60, 1, 33] + DOC2], jnp.int32), seg, pos)
    np.testing.assert_allclose(other[0, 3:], packed[0, 3:], atol=1e-5)
    # Sanity: the change is visible inside document 1, so the check above has teeth.
    assert float(jnp.abs(other[0, 2] - packed[0, 2]).max()) > 1e-2
    # And without the segment boundary, document 2 would see document 1.
    joined = fwd(params, jnp.array([DOC1 + DOC2], jnp.int32), jnp.ones_like(seg), pos)
    assert float(jnp.abs(joined[0, 3:] - packed[0, 3:]).max()) > 1e-2


# ---- remat and precision ------------------------------------------------------------------


def ce_loss(model, params, inputs, targets):
    seg, pos = jnp.ones_like(inputs), jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    logits = model.apply({"params": params}, inputs, seg, pos)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, TINY.vocab_size)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(scope="module")
def base(batch):
    model, params, _ = make(TINY)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: ce_loss(model, p, *batch)))(params)
    return params, loss, grads


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_policies_give_same_loss_and_grads(base, batch, remat):
    params, loss, grads = base
    model = Transformer(dataclasses.replace(TINY, remat=remat))
    # Same param tree: a checkpoint is usable whatever the remat policy.
    abstract = jax.eval_shape(lambda k: init_params(model, k), jax.random.key(0))
    assert jax.tree.structure(nn.unbox(abstract)) == jax.tree.structure(params)
    loss_r, grads_r = jax.jit(jax.value_and_grad(lambda p: ce_loss(model, p, *batch)))(params)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads_r, grads)
    assert float(optax.tree.norm(grads)) > 1e-3  # gradients are not trivially zero


@pytest.mark.parametrize("attention", ["reference", "xla"])
def test_attention_implementations_give_same_loss_and_grads(base, batch, attention):
    """The default (blockwise, custom backward) against plain softmax attention, through the model."""
    params, loss, grads = base
    assert TINY.attention.kernel == "auto"  # blockwise on this CPU
    model = Transformer(TINY.replace(attention=dict(kernel=attention)))
    loss_r, grads_r = jax.jit(jax.value_and_grad(lambda p: ce_loss(model, p, *batch)))(params)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads_r, grads)


def test_bfloat16_logits_close_to_float32(base, batch):
    params, inputs = base[0], batch[0]
    seg, pos = jnp.ones_like(inputs), jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    f32 = make(TINY)[2](params, inputs, seg, pos)
    bf16_model = Transformer(dataclasses.replace(TINY, compute_dtype="bfloat16"))
    bf16 = jax.jit(lambda p: bf16_model.apply({"params": p}, inputs, seg, pos))(params)
    assert f32.dtype == jnp.float32 and bf16.dtype == jnp.float32
    assert float(jnp.abs(f32).mean()) > 0.1  # logits are big enough for the comparison to mean something
    assert float(jnp.abs(bf16 - f32).mean()) < 0.05
    assert float(jnp.abs(bf16 - f32).mean()) > 0  # bf16 really was used


def test_bfloat16_grads_close_to_float32(base, batch):
    """The bfloat16 backward (16-bit residuals, float32 weight gradients) tracks the float32 one."""
    params, _, grads = base
    bf16_model = Transformer(dataclasses.replace(TINY, compute_dtype="bfloat16"))
    grads_bf16 = jax.jit(jax.grad(lambda p: ce_loss(bf16_model, p, *batch)))(params)
    for g, r in zip(jax.tree.leaves(grads_bf16), jax.tree.leaves(grads)):
        assert g.dtype == jnp.float32
        assert float(jnp.linalg.norm(g - r)) <= 0.05 * float(jnp.linalg.norm(r)) + 1e-6


def test_bfloat16_residuals_are_not_stacked_as_float32():
    """The layer scan keeps bfloat16 activations for the backward pass in 16 bits.

    XLA:CPU upcasts a stacked bfloat16 residual to float32 as a whole (see lm.model.stash);
    this looks for float32 arrays of one activation per layer in the compiled backward pass.
    """
    spec = TINY.replace(n_layers=3, mlp=dict(d_ff=48), max_seq_len=64, compute_dtype="bfloat16")
    model = Transformer(spec)
    b, t = 4, 64
    tokens = jnp.zeros((b, t), jnp.int32)
    abstract = nn.unbox(jax.eval_shape(lambda k: init_params(model, k), jax.random.key(0)))
    hlo = jax.jit(jax.grad(lambda p: ce_loss(model, p, tokens, tokens))).lower(abstract).compile().as_text()
    layer_stacks = [tuple(map(int, dims.split(","))) for dims in re.findall(r"f32\[(3,[0-9,]+)\]", hlo)]
    activation_size = b * t * spec.d_model
    assert layer_stacks  # the weight gradients are float32 stacks, so the pattern does match
    assert not [s for s in layer_stacks if math.prod(s[1:]) >= activation_size // 2]


# ---- initial loss -------------------------------------------------------------------------


def test_untrained_loss_is_log_vocab():
    spec = dataclasses.replace(TINY, vocab_size=256, init_std=0.02)
    model, params, _ = make(spec, seed=3, real_init=True)
    tokens = jax.random.randint(jax.random.key(4), (4, 17), 0, spec.vocab_size)
    loss = float(jax.jit(lambda p: ce_loss(model, p, tokens[:, :-1], tokens[:, 1:]))(params))
    assert abs(loss - math.log(spec.vocab_size)) < 0.1
