"""LoRA: adapter shapes and counts, a zero B starts at the base, merging equals the adapted
model, and training adapters leaves the base bit for bit with optimizer state for adapters only."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config
from lm.model.lora import is_adapter, merge_lora
from lm.model.params import leaf_paths, merge_trees
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.train.setup import build_run, host_batch

R = 4


def config(rank=R, **model):
    c = base_config()
    c.model.update(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        max_seq_len=16,
        lora_rank=rank,
        lora_alpha=8.0,
        **model,
    )
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.1)
    c.train.update(batch_size=4, steps=10)
    c.data.seq_len = 16
    return c


def params_of(c, seed=0):
    model = Transformer(ModelSpec.from_config(c.model))
    return nn.unbox(jax.jit(lambda r: init_params(model, r))(jax.random.PRNGKey(seed)))


def shapes_of(c):
    model = Transformer(ModelSpec.from_config(c.model))
    return nn.unbox(jax.eval_shape(lambda r: init_params(model, r), jax.random.PRNGKey(0)))


def tokens(seed=0):
    ids = np.random.default_rng(seed).integers(0, 64, (2, 16)).astype(np.int32)
    return ids, np.ones_like(ids), np.tile(np.arange(16, dtype=np.int32), (2, 1))


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_trainable_count_is_rank_times_in_plus_out_per_target_and_layer(mlp):
    c = config(mlp=mlp)
    p = shapes_of(c)
    d, h, n, kv, f, layers = 32, 8, 4, 2, 48, 2
    per_layer = {"wq": d + n * h, "wk": d + kv * h, "wv": d + kv * h, "wo": n * h + d}
    per_layer |= (
        {"w_gate": d + f, "w_up": d + f, "w_down": f + d} if mlp == "swiglu" else {"w_in": d + f, "w_down": f + d}
    )
    adapters = {path: x.size for path, x in zip(leaf_paths(p), jax.tree.leaves(p)) if "_lora_" in path}
    assert sum(adapters.values()) == R * layers * sum(per_layer.values())
    assert {path.split("/")[-1].rsplit("_lora_", 1)[0] for path in adapters} == set(per_layer)
    only_q = shapes_of(config(lora_targets=("wq",), mlp=mlp))
    assert sum(
        x.size for path, x in zip(leaf_paths(only_q), jax.tree.leaves(only_q)) if "_lora_" in path
    ) == R * layers * (d + n * h)


def test_zero_b_starts_at_the_base_and_merging_equals_the_adapted_model():
    c, base_c = config(), config(rank=0)
    base = params_of(base_c, seed=1)
    adapted = params_of(c, seed=2)
    # the adapted model with the base's weights and its fresh adapters (B = 0) is the base
    with_base = jax.tree_util.tree_map_with_path(lambda path, x: x if is_adapter(path) else _at(base, path), adapted)
    ids, seg, pos = tokens()
    base_model, lora_model = (
        Transformer(ModelSpec.from_config(base_c.model)),
        Transformer(ModelSpec.from_config(c.model)),
    )
    base_apply = jax.jit(lambda p: base_model.apply({"params": p}, ids, seg, pos))
    lora_apply = jax.jit(lambda p: lora_model.apply({"params": p}, ids, seg, pos))
    want = base_apply(base)
    # B = 0 adds exact zeros, but the two programs may fuse and sum differently: a few ulp of the logits
    np.testing.assert_allclose(lora_apply(with_base), want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))
    # with trained-looking adapters (B != 0) the output moves, and the merged plain model equals it
    rng = np.random.default_rng(3)
    moved = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype) if is_adapter(path) else x, with_base
    )
    got = lora_apply(moved)
    assert float(jnp.max(jnp.abs(got - want))) > 1e-3
    merged = merge_lora(moved, c.model.lora_alpha, R)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    np.testing.assert_allclose(base_apply(merged), got, atol=2e-5, rtol=1e-5)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_training_adapters_keeps_the_base_bit_for_bit_and_optimizer_state_for_adapters_only():
    c = config()
    base = params_of(config(rank=0), seed=1)
    run = build_run(c, devices=jax.devices()[:1], trainable=is_adapter)
    state, frozen = run.init(base=base)
    frozen_before = jax.device_get(frozen)
    opt_paths = leaf_paths(state.opt_state)
    assert opt_paths and all("_lora_" in p for p in opt_paths if "/" in p and not p.endswith("count"))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(state.params))
    assert all(is_adapter(path) for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0])
    step = run.bind(run.train_step(), frozen)
    before = jax.device_get(state.params)
    batch = run.placer().from_global(host_batch(run.signature(), vocab_size=64))
    for _ in range(3):
        state, metrics = step(state, batch)
    after = jax.device_get(state.params)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert all(changed)  # every adapter (A and B) moved
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(jax.device_get(frozen))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.tree.leaves(frozen_before)[0], jax.tree.leaves(base)[0])


def test_adapter_step_equals_full_step_restricted_to_adapters():
    """The frozen split changes nothing but what trains: the adapters' update equals that of a run
    training every param, read at the adapter leaves, when the base gets no learning rate."""
    c = config()
    c.optim.weight_decay = 0.0
    base = params_of(config(rank=0), seed=1)
    split = build_run(c, devices=jax.devices()[:1], trainable=is_adapter)
    state, frozen = split.init(base=base, seed=5)
    rng = np.random.default_rng(0)  # nonzero B, so A gets a gradient too
    state = state.replace(
        params=jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), state.params)
    )
    batch = host_batch(split.signature(), vocab_size=64)
    loss = lambda p: split.loss_fn(p, split.placer().from_global(batch), {}, None)[0]
    full_params = merge_trees(jax.device_get(state.params), jax.device_get(frozen["base"]))
    grads_full = jax.jit(jax.grad(loss))(full_params)
    grads_split = jax.jit(jax.grad(lambda p, f: loss(merge_trees(p, f))))(state.params, frozen["base"])
    for path, g in jax.tree_util.tree_flatten_with_path(grads_split)[0]:
        np.testing.assert_allclose(g, _at(grads_full, path), rtol=1e-5, atol=1e-8)
