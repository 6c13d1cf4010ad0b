"""Muon for the blocks' matrices (AdamW for the rest) and the warmup-stable-decay schedule:
against optax.contrib.muon on the same matrices, a stacked [layers, ...] weight orthogonalised
layer by layer, the schedule against a hand computation, and a (2,2,2) mesh equal to one device."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from lm.config import base_config
from lm.train.optim import make_optimizer, make_schedule, muon_dims
from lm.train.setup import build_run, host_batch


def optim(**kw):
    o = base_config().optim
    o.update(optimizer="muon", lr=0.01, muon_lr=0.05, warmup_steps=0, grad_clip=0.0, weight_decay=0.1)
    o.update(kw)
    return o


def rand(key, shape):
    return jax.random.normal(jax.random.PRNGKey(key), shape)


def directions(o, params, grads_seq):
    """Each step's update as applied (-lr * direction) with a constant lr of o.lr."""
    tx, _ = make_optimizer(o, 100)
    state, out = tx.init(params), []
    for g in grads_seq:
        d, state = tx.update(g, state, params)
        out.append(jax.tree.map(lambda x: -o.lr * x, d))
        params = jax.tree.map(lambda p, u: p + u, params, out[-1])
    return out


def reference(o, params, grads_seq, dims):
    """optax.contrib.muon over the same steps (its Adam branch is never compared)."""
    tx = optax.contrib.muon(
        learning_rate=o.muon_lr, beta=o.muon_momentum, ns_steps=o.muon_ns_steps, weight_decay=o.weight_decay,
        eps=o.eps, nesterov=True, muon_weight_dimension_numbers=dims,
    )  # fmt: skip
    state, out = tx.init(params), []
    for g in grads_seq:
        u, state = tx.update(g, state, params)
        out.append(u)
        params = jax.tree.map(lambda p, v: p + v, params, u)
    return out


def test_matrices_follow_optax_muon_and_the_rest_adamw():
    params = {"w_up": rand(0, (16, 24)), "w_down": rand(1, (24, 16)), "embedding": rand(2, (10, 16))}
    grads = [jax.tree.map(lambda p, i=i: rand(10 + i, p.shape), params) for i in range(3)]
    o = optim()
    ours = directions(o, params, grads)
    theirs = reference(
        o, params, grads, {"w_up": MuonDimensionNumbers(), "w_down": MuonDimensionNumbers(), "embedding": None}
    )
    for a, b in zip(ours, theirs):
        for name in ("w_up", "w_down"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-6 * float(jnp.abs(b[name]).max()))
    adamw = optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=0.0)  # embeddings are not decayed
    state, p = adamw.init(params["embedding"]), params["embedding"]
    for step, g in enumerate(grads):
        u, state = adamw.update(g["embedding"], state, p)
        np.testing.assert_allclose(ours[step]["embedding"], u, rtol=1e-5, atol=1e-8)
        p = p + u


@pytest.mark.parametrize("rms", [0.0, 0.2])
def test_a_stacked_weight_is_a_batch_of_matrices_each_orthogonalised_on_its_own(rms):
    layers, d, h, hd = 3, 16, 2, 4
    params = {"wq": rand(0, (layers, d, h, hd)), "wo": rand(1, (layers, h, hd, d))}
    grads = [jax.tree.map(lambda p, i=i: rand(20 + i, p.shape), params) for i in range(2)]
    o = optim(muon_rms=rms)
    ours = directions(o, params, grads)
    assert muon_dims((jax.tree_util.DictKey("wq"),), params["wq"]) == MuonDimensionNumbers((1,), (2, 3))
    assert muon_dims((jax.tree_util.DictKey("wo"),), params["wo"]) == MuonDimensionNumbers((1, 2), (3,))
    for layer in range(layers):  # each layer alone, as a plain 2-D matrix [fan_in, fan_out]
        flat = lambda t: {"w_up": t["wq"][layer].reshape(d, h * hd), "w_down": t["wo"][layer].reshape(h * hd, d)}  # noqa: E731
        own = directions(o, flat(params), [flat(g) for g in grads])
        for a, b in zip(ours, own):
            for name in ("w_up", "w_down"):
                np.testing.assert_allclose(flat(a)[name], b[name], rtol=1e-4, atol=1e-7)
    # the first update is the orthogonalised gradient: its singular values sit near 1 (Newton-Schulz
    # leaves them in roughly [0.5, 1.5]) once the shape scale and the rate are divided out
    first = ours[0]["wq"][0].reshape(d, h * hd) / -o.muon_lr - o.weight_decay * params["wq"][0].reshape(d, h * hd)
    scale = rms * math.sqrt(d) if rms else 1.0  # fan_out 8 < fan_in 16: the width rule gives 1
    s = np.linalg.svd(np.asarray(first) / scale, compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5


def wsd_by_hand(t, lr, warmup, total, fraction, shape, end):
    start = max(total - max(round(fraction * total), 1), warmup)
    if t < warmup:
        return lr * t / warmup
    if t < start:
        return lr
    p = min((t - start) / (total - start), 1.0)
    f = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(p)}[shape]
    return end + (lr - end) * f


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_wsd_schedule_is_the_hand_computation(shape, fraction):
    o = optim(schedule="wsd", lr=0.3, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=fraction, decay_shape=shape)
    s = make_schedule(o, 100)
    for t in range(0, 111):
        want = wsd_by_hand(t, 0.3, 10, 100, fraction, shape, 0.03)
        assert float(s(t)) == pytest.approx(want, rel=1e-6, abs=1e-9), t
    assert float(s(100)) == pytest.approx(0.03) and float(s(50)) == pytest.approx(0.3)


def tiny(devices=1, **optim_kw):
    c = base_config()
    c.model.update(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    c.data.seq_len = 16
    c.train.update(batch_size=8, steps=20)
    c.optim.update(optimizer="muon", schedule="wsd", warmup_steps=2, decay_fraction=0.5, **optim_kw)
    if devices == 8:
        c.mesh.update(data=2, fsdp=2, tensor=2)
    return c


def run_steps(c, devices, steps=3):
    run = build_run(c, devices=jax.devices()[:devices])
    state = run.init_state(seed=0)
    signature = run.signature()
    step, placer = run.train_step(signature), run.placer(signature)
    logged = []
    for i in range(steps):
        state, m = step(state, placer.from_global(host_batch(signature, seed=i, vocab_size=64)))
        logged.append(float(m["lr"]))
    return jax.device_get(state.params), logged, run


def test_muon_on_a_2x2x2_mesh_equals_one_device_and_logs_the_applied_rate():
    one, lr1, run = run_steps(tiny(), 1)
    eight, lr8, _ = run_steps(tiny(8), 8)
    assert lr1 == lr8 == pytest.approx([float(run.schedule(i)) for i in range(3)])
    assert lr1 == pytest.approx([0.0, 1.5e-3, 3e-3])  # warmup of 2 steps to optim.lr
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), one, eight)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_the_planner_counts_the_optimizer_state_the_run_holds(optimizer, param_dtype):
    from lm.plan.memory import estimate

    c = tiny()
    c.optim.optimizer, c.train.param_dtype = optimizer, param_dtype
    state = build_run(c, devices=jax.devices()[:1]).abstract_state()
    held = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim > 0)  # noqa: E731
    parts = estimate(c, "pretrain", 1).parts
    assert parts["params"] == held(state.params)
    assert parts["optimizer"] == held(state.opt_state) - (12 if optimizer == "muon" else 0)  # Muon's 3 NS coefficients
