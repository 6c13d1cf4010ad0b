"""Delayed fp8 scaling (model.fp8_scaling=delayed, lm.model.fp8): a product scales by the largest
amax of its history (by hand, saturation included) and records this step's amaxes as the
history's gradient; an empty history scales as current scaling does, bitwise; the train step
shifts each history by one row, accumulates micro-batches' amaxes by their largest, leaves the
histories out of the optimizer, and resumes exactly from a host copy of the state; LoRA and
pipelines are refused in one line."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm.config import validate
from lm.errors import UserError
from lm.model import fp8

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "bench" / "fp8.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def rounded(x, amax, dtype, top):
    """x / (amax / top) rounded to `dtype` by ml_dtypes, saturated at the range; and the scale."""
    scale = np.float32(amax) * np.float32(1 / top)
    q = np.clip(x.astype(np.float32) * (np.float32(1) / scale), -top, top).astype(dtype)
    return q.astype(np.float32), scale


def test_a_product_scales_by_its_history_and_records_this_steps_amaxes():
    rng = np.random.default_rng(0)
    x, w, g = (rng.normal(size=s).astype(np.float32) for s in ((6, 8), (8, 5), (6, 5)))
    history = np.zeros((3, 3), np.float32)  # columns x, w, g; the largest of each column is used
    history[1] = [0.5 * np.abs(x).max(), 2.0 * np.abs(w).max(), 4.0]  # x's scale too small: it saturates
    history[2] = [0.1, 0.1, 0.1]
    y, vjp = jax.vjp(lambda a, b, h: fp8.matmul("td,df->tf", a, b, history=h), x, w, history)
    dx, dw, recorded = vjp(g)

    xq, sx = rounded(x, history[:, 0].max(), ml_dtypes.float8_e4m3fn, 448.0)
    wq, sw = rounded(w, history[:, 1].max(), ml_dtypes.float8_e4m3fn, 448.0)
    gq, sg = rounded(g, 4.0, ml_dtypes.float8_e5m2, 57344.0)
    assert (np.abs(xq) == 448.0).any()  # saturated, not NaN
    np.testing.assert_allclose(y, (xq @ wq) * (sx * sw), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dx, (gq @ wq.T) * (sg * sw), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw, (xq.T @ gq) * (sx * sg), rtol=1e-6, atol=1e-7)
    want = np.zeros_like(history)
    want[0] = [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()]
    np.testing.assert_array_equal(recorded, want)


def test_an_empty_history_scales_as_current_scaling_does():
    rng = np.random.default_rng(1)
    x, w1, w2 = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8), (8, 3), (8, 5)))
    specs = ["td,df->tf", "td,de->te"]

    def loss(history):
        def f(a, b, c):
            y1, y2 = fp8.matmuls(a, specs, [b, c], history=history)
            return (y1**2).sum() + y2.sum()

        return jax.value_and_grad(f, argnums=(0, 1, 2))(x, w1, w2)

    empty = jnp.zeros((5, fp8.history_columns(2)), jnp.float32)
    for a, b in zip(jax.tree.leaves(loss(empty)), jax.tree.leaves(loss(None))):
        np.testing.assert_array_equal(a, b)


def histories(state) -> dict:
    """{'attn/fp8_qkv': [layers, history, columns], ...} of a state's params."""
    blocks = jax.device_get(state.params)["blocks"]
    return {f"{m}/{k}": v["amax_history"] for m in blocks for k, v in blocks[m].items() if k.startswith("fp8_")}


def delayed(steps: int, micro_batches: int = 1):
    c = bench.config("delayed", steps=steps)
    c.model.fp8_history = 4
    c.train.micro_batches = micro_batches
    return c


def test_the_step_shifts_each_history_and_a_resumed_run_is_exact():
    c = delayed(6)
    straight, end = bench.run(c, 6)
    first, one = bench.run(c, 1)
    _, two = bench.run(c, 2)
    h1, h2 = histories(one), histories(two)
    assert sorted(h1) == ["attn/fp8_o", "attn/fp8_qkv", "mlp/fp8_down", "mlp/fp8_in"]
    assert h1["attn/fp8_qkv"].shape == (2, 4, 7) and h1["mlp/fp8_in"].shape == (2, 4, 5)
    for name in h1:
        assert (h1[name][:, 0] > 0).all() and not h1[name][:, 1:].any()  # one step recorded
        np.testing.assert_array_equal(h2[name][:, 1], h1[name][:, 0])  # shifted down by the next step
        assert (h2[name][:, 0] > 0).all() and not h2[name][:, 2:].any()
    ends = histories(end)
    assert all((v > 0).all() for v in ends.values())  # 6 steps fill a history of 4; the oldest dropped

    _, mid = bench.run(c, 3)
    from lm.train.setup import build_run

    run = build_run(c, devices=jax.devices()[:1])
    rest, end2 = bench.run(c, 6, state=jax.device_put(jax.device_get(mid), run.state_shardings), start=3)
    assert bench.run(c, 3)[0] + rest == straight
    for a, b in zip(jax.tree.leaves(jax.device_get(end)), jax.tree.leaves(jax.device_get(end2))):
        np.testing.assert_array_equal(a, b)
    assert first == straight[:1]


def test_micro_batches_record_the_largest_amax_and_the_optimizer_never_sees_a_history():
    one, two = (histories(bench.run(delayed(1, n), 1)[1]) for n in (1, 2))
    # the first layer's input and every weight are the same however the batch is split
    np.testing.assert_allclose(two["attn/fp8_qkv"][0, 0, :4], one["attn/fp8_qkv"][0, 0, :4], rtol=1e-6)
    for name, cols in (("attn/fp8_o", [1]), ("mlp/fp8_in", [1, 2]), ("mlp/fp8_down", [1])):
        np.testing.assert_allclose(two[name][:, 0, cols], one[name][:, 0, cols], rtol=1e-6)
    _, state = bench.run(delayed(2), 2)
    moments = [  # Adam's moments of the histories stay zero
        x
        for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state.opt_state))[0]
        if fp8.is_history(path)
    ]
    assert len(moments) == 8 and not any(x.any() for x in moments)  # mu and nu of 4 histories


@pytest.mark.parametrize(
    "overrides, says",
    [
        (dict(model=dict(lora_rank=4)), "LoRA"),
        (dict(mesh=dict(stage=2), model=dict(n_layers=2)), "pipeline"),
        (dict(model=dict(fp8_history=0)), "expected >= 1"),
    ],
)
def test_what_delayed_scaling_cannot_do_is_refused_in_one_line(overrides, says):
    c = delayed(2)
    for section, values in overrides.items():
        c[section].update(values)
    with pytest.raises(UserError, match=says) as e:
        validate(c)
    assert "\n" not in str(e.value)
