"""Optimizer: weight-decay mask on a real param tree, the LR schedule, AdamW + clipping vs numpy."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.config import base_config
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.train.optim import apply_update, decay_mask, make_optimizer, make_schedule

# Every param name the model can produce, classified by hand (a new kind must be added here).
MATRICES = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in", "head"}
EMBEDDINGS = {"embedding", "pos_embedding"}
NORMS_AND_BIASES = {
    "scale",
    "bias",
    "wq_bias",
    "wk_bias",
    "wv_bias",
    "wo_bias",
    "w_gate_bias",
    "w_up_bias",
    "w_down_bias",
    "w_in_bias",
}


def optim_config(**kw):
    o = base_config().optim
    o.update(kw)
    return o


def abstract_params(**model_kw):
    c = base_config()
    c.model.update(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=16)
    c.model.update(model_kw)
    model = Transformer(ModelSpec.from_config(c.model))
    return nn.unbox(jax.eval_shape(lambda k: init_params(model, k), jax.random.PRNGKey(0)))


# Two models between them produce every kind of param: biases, layernorm bias, learned positions,
# an untied head, and both MLP flavours.
MODELS = [
    dict(mlp="swiglu", norm="layernorm", use_bias=True, position="learned", tie_embeddings=False),
    dict(mlp="gelu", norm="rmsnorm", use_bias=True, position="rope", tie_embeddings=True),
]


@pytest.mark.parametrize("decay_embeddings", [False, True])
@pytest.mark.parametrize("decay_norms", [False, True])
def test_decay_mask_on_real_param_trees(decay_embeddings, decay_norms):
    o = optim_config(decay_embeddings=decay_embeddings, decay_norms_and_biases=decay_norms)
    seen = set()
    for model_kw in MODELS:
        params = abstract_params(**model_kw)
        mask = decay_mask(params, o)
        assert jax.tree.structure(mask) == jax.tree.structure(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            name = path[-1].key
            got = _lookup(mask, path)
            seen.add(name)
            if name in MATRICES:
                assert got is True, jax.tree_util.keystr(path)
                assert leaf.ndim >= 2
            elif name in EMBEDDINGS:
                assert got is decay_embeddings, jax.tree_util.keystr(path)
            elif name in NORMS_AND_BIASES:
                assert got is decay_norms, jax.tree_util.keystr(path)
            else:
                pytest.fail(f"unclassified param {jax.tree_util.keystr(path)}")
    assert seen == MATRICES | EMBEDDINGS | NORMS_AND_BIASES


def test_scanned_norm_scales_are_2d_and_not_decayed():
    params = abstract_params()
    scale = params["blocks"]["attn_norm"]["scale"]
    assert scale.shape == (3, 32)  # [layers, d_model]: a name-based rule is needed, not ndim
    mask = decay_mask(params, optim_config())
    assert mask["blocks"]["attn_norm"]["scale"] is False
    assert mask["blocks"]["mlp_norm"]["scale"] is False
    assert mask["final_norm"]["scale"] is False
    assert mask["blocks"]["attn"]["wq"] is True


def _lookup(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


# ---- schedule -------------------------------------------------------------------------------


def np_schedule(step, lr, warmup, total, min_ratio):
    """Linear warmup from 0, then cosine from lr to lr * min_ratio at `total`, flat afterwards."""
    if step < warmup:
        return lr * step / warmup
    frac = min(step - warmup, total - warmup) / (total - warmup)
    end = lr * min_ratio
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * frac))


def test_schedule_shape():
    lr, warmup, total, ratio = 2e-3, 10, 100, 0.1
    s = make_schedule(optim_config(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio), total)
    values = np.array([float(s(i)) for i in range(total + 20)])
    assert values[0] == 0.0
    np.testing.assert_allclose(values[warmup], lr, rtol=1e-6)
    np.testing.assert_allclose(values[5], lr / 2, rtol=1e-6)
    np.testing.assert_allclose(values[total:], lr * ratio, rtol=1e-5)
    assert np.all(np.diff(values[: warmup + 1]) > 0)  # warmup rises
    assert np.all(np.diff(values[warmup : total + 1]) < 0)  # strictly decays after warmup
    assert values.max() <= lr * (1 + 1e-6)
    ref = [np_schedule(i, lr, warmup, total, ratio) for i in range(total + 20)]
    np.testing.assert_allclose(values, ref, rtol=1e-5, atol=1e-9)


def test_schedule_decay_steps_overrides_total():
    o = optim_config(lr=1.0, warmup_steps=5, min_lr_ratio=0.2, decay_steps=40)
    s = make_schedule(o, 1000)
    np.testing.assert_allclose(float(s(40)), 0.2, rtol=1e-6)
    np.testing.assert_allclose(float(s(500)), 0.2, rtol=1e-6)
    np.testing.assert_allclose(float(s(20)), np_schedule(20, 1.0, 5, 40, 0.2), rtol=1e-5)


# ---- AdamW + clipping against numpy ----------------------------------------------------------


def np_adamw(params, grads_fn, steps, o, total, mask):
    """Hand-written AdamW in float64: clip by global norm, Adam with bias correction,
    decoupled weight decay on masked leaves, lr from the schedule at the 0-based step."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    norms = []
    for t in range(steps):
        g = {k: x.astype(np.float64) for k, x in grads_fn(p).items()}
        norm = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
        norms.append(norm)
        if norm > o.grad_clip:
            g = {k: x * (o.grad_clip / norm) for k, x in g.items()}
        lr = np_schedule(t, o.lr, o.warmup_steps, total, o.min_lr_ratio)
        for k in p:
            m[k] = o.b1 * m[k] + (1 - o.b1) * g[k]
            v[k] = o.b2 * v[k] + (1 - o.b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - o.b1 ** (t + 1)), v[k] / (1 - o.b2 ** (t + 1))
            u = m_hat / (np.sqrt(v_hat) + o.eps) + (o.weight_decay * p[k] if mask[k] else 0.0)
            p[k] = p[k] - lr * u
    return p, m, v, norms


TARGET = {"kernel": np.array([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]]), "scale": np.array([2.0, -1.0, 0.25])}


def quadratic_grads(p):
    """Gradient of sum(w * (p - target)^2) with per-leaf weights, so norms vary by step."""
    return {"kernel": 2.0 * (p["kernel"] - TARGET["kernel"]), "scale": 6.0 * (p["scale"] - TARGET["scale"])}


@pytest.mark.parametrize("steps, warmup", [(1, 0), (4, 2)])
def test_adamw_with_clipping_matches_numpy(steps, warmup):
    o = optim_config(
        lr=0.1, warmup_steps=warmup, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.3, grad_clip=0.5
    )
    total = 10
    params0 = {
        "kernel": np.array([[0.5, 0.1, -0.3], [0.2, -0.4, 0.6]], np.float32),
        "scale": np.array([1.0, 1.0, 1.0], np.float32),
    }
    opt, schedule = make_optimizer(o, total)
    params = jax.tree.map(jnp.asarray, params0)
    state = opt.init(params)
    for t in range(steps):
        grads = jax.tree.map(jnp.asarray, quadratic_grads(jax.tree.map(np.asarray, params)))
        direction, state = opt.update(grads, state, params)
        params = apply_update(params, direction, schedule(t))

    # "kernel" is a matrix (decayed), "scale" a norm (not decayed) by the default mask
    ref_p, ref_m, ref_v, norms = np_adamw(
        params0, quadratic_grads, steps, o, total, mask={"kernel": True, "scale": False}
    )
    assert all(n > 2 * o.grad_clip for n in norms)  # clipping is active at every step
    for k in params0:
        np.testing.assert_allclose(np.asarray(params[k]), ref_p[k], rtol=1e-5, atol=1e-7, err_msg=k)
        # the moments see the *clipped* gradient (Adam's first step alone is scale-invariant)
        np.testing.assert_allclose(
            np.asarray(optax.tree_utils.tree_get(state, "mu")[k]), ref_m[k], rtol=1e-5, atol=1e-9, err_msg=k
        )
        np.testing.assert_allclose(
            np.asarray(optax.tree_utils.tree_get(state, "nu")[k]), ref_v[k], rtol=1e-5, atol=1e-12, err_msg=k
        )
    # the update moved the params (lr is not zero at the last step)
    assert not np.allclose(np.asarray(params["kernel"]), params0["kernel"])


def test_no_clipping_transform_when_grad_clip_is_zero():
    o = optim_config(lr=0.1, warmup_steps=0, grad_clip=0.0, weight_decay=0.0)
    opt, _ = make_optimizer(o, 10)
    params = {"kernel": jnp.zeros((2, 2))}
    grads = {"kernel": jnp.full((2, 2), 100.0)}
    state = opt.init(params)
    _, state = opt.update(grads, state, params)
    np.testing.assert_allclose(np.asarray(optax.tree_utils.tree_get(state, "mu")["kernel"]), 10.0, rtol=1e-6)
