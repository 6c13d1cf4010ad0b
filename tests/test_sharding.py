"""Sharded training on 8 simulated CPU devices matches the single-device run.

One reference run on a (1,1,1) mesh is shared by the module; every other mesh compiles its
step once. Starting states are the reference initial state placed with each mesh's shardings
(except fsdp=8, which is created sharded by create_state, to test sharded creation as well).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.config import base_config, rules_table
from lm.errors import UserError
from lm.model.apply import logits_of
from lm.model.layers import Partitioning
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.sharding import make_mesh, param_shardings, per_device_bytes
from lm.train.losses import masked_cross_entropy
from lm.train.optim import make_optimizer
from lm.train.setup import build_run
from lm.train.state import create_state

B, T, V = 16, 16, 128  # 16 rows: each of the 2 micro-batches still splits over 8 devices
N_MICRO = 2
MESHES = [(8, 1, 1), (1, 8, 1), (1, 2, 4), (2, 2, 2)]
CREATED = {(1, 1, 1), (1, 8, 1)}  # meshes whose state comes from create_state


def config(**model_kw):
    c = base_config()
    # heads, kv heads, d_ff and vocab divisible by tensor=4; d_model by fsdp=8
    c.model.update(vocab_size=V, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=256, max_seq_len=T)
    c.model.update(model_kw)
    # Adam's first update is g / (|g| + eps): with eps=1e-8, float rounding in gradients of
    # size ~eps would be amplified by lr/eps; a larger eps keeps the comparison at float tolerance.
    c.optim.update(lr=1e-3, warmup_steps=0, eps=1e-6)
    c.train.update(batch_size=B, micro_batches=N_MICRO, steps=100)
    c.data.seq_len = T
    return c


def make_batch():
    """Two packed documents per row and rows with different numbers of loss tokens."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[:, 9:] = 2
    pos = np.concatenate([np.arange(9), np.arange(T - 9)]).astype(np.int32)[None].repeat(B, 0)
    mask = np.ones((B, T), np.float32)
    for r in range(B):
        mask[r, : r % 5 * 3] = 0.0
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask, segment_ids=seg, positions=pos)


def mesh_of(shape):
    n = int(np.prod(shape))
    return make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)), jax.devices()[:n])


def build(shape, loss=None):
    c = config()
    c.mesh.update(dict(zip(("data", "fsdp", "tensor"), shape)))
    return build_run(c, loss, devices=jax.devices()[: int(np.prod(shape))])


def put(run_, batch):
    return run_.placer(run_.signature(extra={k: (v.shape[1:], v.dtype) for k, v in batch.items() if v.ndim != 2}))(
        batch
    )


@functools.cache
def run(shape):
    """One train step on a mesh of `shape`; returns host copies and sharding facts."""
    r = build(shape)
    if shape in CREATED:
        state = r.init_state(0)
    else:
        state = jax.device_put(run((1, 1, 1))["init"], r.state_shardings)
    out = {"init": jax.device_get(state)}
    emb = state.params["embedding"]
    out["embedding_shards"] = [(s.index, s.device, s.data.shape) for s in emb.addressable_shards]
    state, metrics = r.train_step()(state, put(r, make_batch()))
    out["param_bytes"] = per_device_bytes(state.params)
    out["opt_bytes"] = per_device_bytes(state.opt_state)
    out["state"] = jax.device_get(state)
    out["metrics"] = jax.device_get(metrics)
    return out


@pytest.fixture(scope="module")
def reference():
    return run((1, 1, 1))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_step_matches_single_device(reference, shape):
    got, ref = run(shape), reference
    for k in ("loss", "log_z_sq", "grad_norm", "lr"):
        np.testing.assert_allclose(got["metrics"][k], ref["metrics"][k], rtol=1e-5, err_msg=k)
    assert float(got["metrics"]["tokens"]) == float(ref["metrics"]["tokens"]) == make_batch()["loss_mask"].sum()
    assert int(got["state"].step) == int(ref["state"].step) == 1

    flat_ref = jax.tree_util.tree_leaves_with_path(ref["state"].params)
    for (path, r), g in zip(flat_ref, jax.tree.leaves(got["state"].params)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    # the step actually moved the params (otherwise the comparison above proves little)
    assert (
        max(
            float(np.abs(a - b).max())
            for a, b in zip(jax.tree.leaves(ref["state"].params), jax.tree.leaves(ref["init"].params))
        )
        > 5e-4
    )

    # Adam moments are linear / quadratic in the (clipped) gradient: compare them per leaf,
    # relative to the leaf's scale (some gradients are ~1e-5, some ~1e-2).
    for name in ("mu", "nu"):
        r_tree = optax.tree_utils.tree_get(ref["state"].opt_state, name)
        g_tree = optax.tree_utils.tree_get(got["state"].opt_state, name)
        for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(r_tree), jax.tree.leaves(g_tree)):
            scale = float(np.abs(r).max())
            assert scale > 0, (name, jax.tree_util.keystr(path))
            np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * scale, err_msg=f"{name}{jax.tree_util.keystr(path)}")


def test_created_sharded_state_matches_single_device_init(reference):
    got = run((1, 8, 1))
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(reference["init"].params), jax.tree.leaves(got["init"].params)
    ):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # embedding [vocab, embed] with embed -> fsdp: 8 distinct column blocks on 8 distinct devices
    shards = got["embedding_shards"]
    assert len(shards) == 8
    assert len({s[1] for s in shards}) == 8
    starts = sorted(idx[1].start or 0 for idx, _, _ in shards)
    assert starts == list(range(0, 64, 8))
    assert all(shape == (V, 8) for _, _, shape in shards)
    # the single-device reference holds one whole copy
    assert [s[2] for s in reference["embedding_shards"]] == [(V, 64)]


def _nbytes(tree, names=None):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return sum(x.nbytes for p, x in leaves if names is None or p[-1].key in names)


def test_per_device_bytes_shrink_with_sharding(reference):
    total = _nbytes(reference["state"].params)
    norms = _nbytes(reference["state"].params, {"scale"})  # replicated by the default rules
    by_mesh = {s: run(s)["param_bytes"] for s in MESHES}
    assert reference["param_bytes"] == total
    assert by_mesh[(8, 1, 1)] == total  # pure data parallel: every device holds everything
    assert by_mesh[(1, 8, 1)] < by_mesh[(8, 1, 1)]
    assert by_mesh[(1, 2, 4)] < by_mesh[(8, 1, 1)]
    assert by_mesh[(2, 2, 2)] < by_mesh[(8, 1, 1)]
    # every matrix has an embed axis (fsdp=8) -> exactly 1/8 of it per device; norms replicated
    assert by_mesh[(1, 8, 1)] == (total - norms) // 8 + norms
    # optimizer moments are sharded like the params
    assert run((1, 8, 1))["opt_bytes"] < run((8, 1, 1))["opt_bytes"]


def test_make_mesh_errors_name_the_mesh():
    assert len(jax.devices()) == 8
    with pytest.raises(
        UserError, match=r"mesh \{'data': 3, 'stage': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1\}.*8"
    ):
        make_mesh(dict(data=3, fsdp=1, tensor=1))
    with pytest.raises(
        UserError, match=r"mesh \{'data': 2, 'stage': 1, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 4\}"
    ):
        make_mesh(dict(data=2, fsdp=2, tensor=4))
    with pytest.raises(
        UserError, match=r"mesh \{'data': -1, 'stage': 1, 'fsdp': 3, 'expert': 1, 'context': 1, 'tensor': 1\}"
    ):
        make_mesh(dict(data=-1, fsdp=3, tensor=1))
    mesh = make_mesh(dict(data=-1, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}


def test_param_shardings_error_names_the_param():
    c = config(n_kv_heads=2)  # kv_heads -> tensor=4 does not divide 2
    rules = rules_table(c)
    mesh = mesh_of((1, 2, 4))
    model = Transformer(ModelSpec.from_config(c.model))
    boxed = jax.eval_shape(lambda k: init_params(model, k), jax.random.PRNGKey(0))
    with pytest.raises(UserError, match=r"\['blocks'\]\['attn'\]\['w[kv]'\].*dimension 2.*tensor"):
        param_shardings(boxed, mesh, rules)
    # the user-facing path fails the same way, before anything is compiled
    opt, _ = make_optimizer(c.optim, 10)
    with pytest.raises(UserError, match=r"\['attn'\]\['w[kv]'\]"):
        create_state(Transformer(ModelSpec.from_config(c.model), Partitioning(mesh, rules)), opt, mesh, rules, 0)
    # and the same model is fine when tensor divides the kv heads
    shardings = param_shardings(boxed, mesh_of((1, 4, 2)), rules)
    assert nn.unbox(boxed)["blocks"]["attn"]["wk"].shape == (2, 64, 2, 8)
    assert shardings["blocks"]["attn"]["wk"].spec[2] == "tensor"


def weighted_loss(model):
    """Cross-entropy with a per-example weight: a [B] batch field (like rewards or advantages)."""

    def loss_fn(params, batch, frozen, rng):
        del frozen, rng
        mask = batch["loss_mask"] * batch["row_weight"][:, None]
        nll, _, _ = masked_cross_entropy(logits_of(model, params, batch), batch["targets"], mask)
        return nll, {"loss_sum": nll, "count": jnp.sum(batch["loss_mask"])}

    return loss_fn


@functools.cache
def weighted_step(shape):
    r = build(shape, weighted_loss)
    batch = make_batch() | {"row_weight": np.linspace(0.0, 2.0, B).astype(np.float32)}
    extra = {"row_weight": ((), np.float32)}
    step = r.train_step(r.signature(extra=extra))
    state = jax.device_put(run((1, 1, 1))["init"], r.state_shardings)
    device_batch = put(r, batch)
    assert device_batch["row_weight"].shape == (B,)
    state, metrics = step(state, device_batch)
    return jax.device_get(state.params), jax.device_get(metrics), device_batch["row_weight"].sharding


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1)], ids=lambda s: "x".join(map(str, s)))
def test_per_example_field_is_sharded_and_split_into_micro_batches(shape):
    ref_params, ref_metrics, _ = weighted_step((1, 1, 1))
    params, metrics, sharding = weighted_step(shape)
    assert sharding.spec[0] == ("data", "fsdp", "expert")  # the [B] field is split over the batch axes
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the weights matter: an unweighted step lands elsewhere
    assert float(metrics["loss"]) != pytest.approx(float(run(shape)["metrics"]["loss"]), rel=1e-3)
