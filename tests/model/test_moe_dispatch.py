"""The dropless experts' backend pieces: megablox gmm (Pallas's interpreter on CPU) equals ragged_dot
in values and gradients; the CPU stand-in for ragged_all_to_all follows jax's documented semantics;
the exchange moves each assignment to its expert's shard and back; the TPU compiler builds the
sharded layer with the gmm kernel and the ragged all-to-all."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lm.model.layers import Partitioning
from lm.model.moe import dropless, route, sharded_dropless
from lm.model.moe_dispatch import exchange_plan, grouped_dot, ragged_exchange, send_back
from lm.model.spec import ModelSpec
from tests.model.test_moe import config, dense_loop, experts_and_tokens

GMM = functools.partial(grouped_dot, "gmm", interpret=True)


def spec():
    return ModelSpec.from_config(config().model)


@pytest.mark.parametrize("first,held", [(0, 4), (2, 2)])
def test_gmm_equals_ragged_dot_in_values_and_gradients(first, held):
    s = spec()
    x, wg, wu, wd, logits = experts_and_tokens(24)  # 48 assignments: padded to gmm's 128-row tile
    w, ex, _ = route(s, jnp.asarray(logits))
    ws = tuple(jnp.asarray(a[first : first + held]) for a in (wg, wu, wd))

    def run(grouped, x, w, *ws):
        y = dropless(s, x, w, ex, *ws, first=first, grouped=grouped)
        return jnp.sum(jnp.sin(y)), y

    grads = jax.grad(run, argnums=(1, 2, 3, 4, 5), has_aux=True)
    g_gmm, y_gmm = grads(GMM, jnp.asarray(x), w, *ws)
    g_ref, _ = grads(functools.partial(grouped_dot, "ragged_dot"), jnp.asarray(x), w, *ws)
    held_here = (np.asarray(ex) >= first) & (np.asarray(ex) < first + held)
    want = dense_loop(x, np.asarray(w), np.asarray(ex), wg, wu, wd, held_here)
    np.testing.assert_allclose(y_gmm, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), g_gmm, g_ref):
        assert np.all(np.isfinite(a)), name  # rows outside every group give no NaN
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()), err_msg=name)


def on_devices(n: int, fn, *args, specs):
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False))(*args)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_the_cpu_exchange_follows_jaxs_documented_example():
    # jax.lax.ragged_all_to_all's docstring: two devices, operands [1,2,2] and [3,4,0]
    operand = jnp.array([1, 2, 2, 3, 4, 0], jnp.float32)
    vec = lambda a, b: jnp.array(a + b, jnp.int32)  # noqa: E731
    args = (
        operand,
        jnp.zeros(8, jnp.float32),
        vec([0, 1], [0, 1]),  # input offsets
        vec([1, 2], [1, 1]),  # send sizes
        vec([0, 0], [1, 2]),  # output offsets on the receivers
        vec([1, 1], [2, 1]),  # receive sizes
    )
    got = on_devices(2, lambda *a: ragged_exchange(*a, "x", native=False), *args, specs=(P("x"),) * 6)
    np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_rows_reach_their_peer_in_sender_order_and_come_back():
    peers, rows = 4, 5
    rng = np.random.default_rng(0)
    dest = rng.integers(0, peers + 1, size=(peers, rows)).astype(np.int32)  # `peers`: not sent
    order = np.argsort(dest, axis=1, kind="stable")
    dest_sorted = np.take_along_axis(dest, order, 1)
    payload = (100 * np.arange(peers)[:, None] + np.arange(rows)[None]).astype(np.float32)
    payload_sorted = np.take_along_axis(payload, order, 1)

    def run(dest, payload):
        plan = exchange_plan(dest, peers, "x")
        got = ragged_exchange(payload, jnp.full((peers * rows,), -1.0), *plan, "x", native=False)
        back = send_back(got + 0.5, jnp.zeros(rows), plan, "x", native=False)
        return jnp.concatenate([got, back])[None]

    out = np.asarray(on_devices(peers, run, dest_sorted.reshape(-1), payload_sorted.reshape(-1), specs=(P("x"),) * 2))
    for me in range(peers):
        want = np.concatenate([payload_sorted[s][dest_sorted[s] == me] for s in range(peers)])
        got = out[me, : peers * rows]
        np.testing.assert_array_equal(got[: len(want)], want)
        assert np.all(got[len(want) :] == -1)
        sent = dest_sorted[me] < peers
        np.testing.assert_array_equal(out[me, peers * rows :][sent], payload_sorted[me][sent] + 0.5)
        assert np.all(out[me, peers * rows :][~sent] == 0)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_sharded_dropless_on_an_expert_mesh_equals_one_device_with_gmm_rows():
    # the rule table's batch axes include `expert`: every assignment is exchanged
    from lm.config import base_config, rules_table

    s = spec()
    x, wg, wu, wd, logits = experts_and_tokens(32)
    w, ex, _ = route(s, jnp.asarray(logits))
    want = dropless(s, jnp.asarray(x), w, ex, wg, wu, wd)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 2, 4, 1), ("data", "stage", "fsdp", "expert", "tensor"))
    part = Partitioning(mesh=mesh, rules=rules_table(base_config()))
    rows = lambda a: jnp.asarray(a).reshape(8, 4, -1)  # noqa: E731  [batch rows, tokens, ...] as a layer holds them
    got = sharded_dropless(s, part, rows(x), rows(w), rows(ex), wg, wu, wd).reshape(32, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


TPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.slow
@pytest.mark.skipif(not TPU, reason="needs lm[tpu] (libtpu)")
def test_the_tpu_compiler_builds_gmm_and_the_ragged_all_to_all():
    from lm.config import base_config, rules_table
    from lm.plan.aot import target_devices
    from lm.plan.hardware import parse_target

    s = ModelSpec.from_config(config(d_model=256, expert_d_ff=512, compute_dtype="bfloat16").model)
    devices = np.array(target_devices(parse_target("v5p-8"))).reshape(1, 1, 1, 4, 1)
    mesh = Mesh(devices, ("data", "stage", "fsdp", "expert", "tensor"))
    part = Partitioning(mesh=mesh, rules=rules_table(base_config()))
    n, e, k, d, f = 4096, s.moe.n_experts, s.moe.experts_per_token, s.d_model, s.moe.expert_d_ff
    struct = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    rows = P(("data", "fsdp", "expert"))
    args = (
        struct((4, n // 4, d), jnp.bfloat16, rows),
        struct((4, n // 4, k), jnp.float32, rows),
        struct((4, n // 4, k), jnp.int32, rows),
        struct((e, d, f), jnp.float32, P("expert")),
        struct((e, d, f), jnp.float32, P("expert")),
        struct((e, f, d), jnp.float32, P("expert")),
    )
    loss = lambda x, w, ex, *ws: jnp.sum(sharded_dropless(s, part, x, w, ex, *ws))  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5))).lower(*args).compile().as_text()
    assert "ragged-all-to-all" in hlo
    assert "tpu_custom_call" in hlo  # megablox gmm (and its backward) as Mosaic kernels
