"""Training with model.fp8 (lm.model.fp8): 50 steps of the tiny model on CPU follow the plain run
within a stated tolerance with current and with delayed scaling (bench/fp8.py's runs: it prints
and plots the same curves), with current scaling the train
state is the plain run's (checkpoints interchange), resuming from a host copy of the state is
exact (current scaling keeps no state), and one step on a (data 2, fsdp 2, tensor 2) mesh of 8
simulated devices equals one device."""

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "bench" / "fp8.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# Measured (bench/fp8.py, 50 steps, float32 reference, at a loss of ~1.5): the largest gap 0.0043
# to 0.0051 (0.3%) with current scaling, 0.0048 with delayed; bfloat16 reference: 0.0034. The
# tolerance leaves ~4x room for other machines' float summation orders; a broken scale or
# gradient moves the curve by tenths.
TOLERANCE = 0.02


def test_fifty_fp8_steps_follow_the_plain_run_with_current_and_delayed_scaling():
    got = bench.curves(50)
    ref = np.array(got["off"])
    assert ref[-1] < ref[0] - 2.0  # the stream is learned (ln 64 = 4.16 -> ~1.5)
    assert not np.array_equal(got["current"], got["delayed"])  # the scales differ after the first step
    assert got["current"][0] == got["delayed"][0]  # ... and not at it: an empty history scales currently
    for mode in ("current", "delayed"):
        f8 = np.array(got[mode])
        assert not np.array_equal(ref, f8)  # fp8 is on
        gap = np.abs(f8 - ref).max()
        assert gap < TOLERANCE, (mode, gap, ref.tolist(), f8.tolist())


def leaves(state):
    return jax.tree.leaves(jax.device_get(state))


def test_the_state_is_the_plain_runs_and_resuming_is_exact():
    from lm.train.setup import build_run

    plain = build_run(bench.config("off"), devices=jax.devices()[:1]).abstract_state()
    c = bench.config("current", steps=6)
    f8 = build_run(c, devices=jax.devices()[:1]).abstract_state()
    assert jax.tree.structure(plain) == jax.tree.structure(f8)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(plain)] == [(x.shape, x.dtype) for x in jax.tree.leaves(f8)]
    straight, end = bench.run(c, 6)
    first, mid = bench.run(c, 3)
    host = jax.device_get(mid)  # what a checkpoint holds: nothing else carries over
    run = build_run(c, devices=jax.devices()[:1])
    resumed = jax.device_put(host, run.state_shardings)
    rest, end2 = bench.run(c, 6, state=resumed, start=3)
    assert first + rest == straight
    for a, b in zip(leaves(end), leaves(end2)):
        np.testing.assert_array_equal(a, b)


def rel_gap(a, b) -> float:
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices (tests/conftest.py)")
def test_one_step_on_a_2x2x2_mesh_equals_one_device():
    """The scales are global (the amax of a sharded tensor is reduced over the mesh) and the loss
    agrees to float32 rounding. Past that, fp8 amplifies: partial sums added in another order move
    a few values across an e4m3 rounding step (6%), and the layers after them see a perturbation
    large enough to move more. Measured: the plain model's gradients agree to ~5e-7 (relative
    norm), the fp8 model's to ~5e-3 (the small wk gradients) and ~1e-4 for most weights, so the
    gradients (Adam's moments after the step) are compared at 2e-2 here, not the updated params:
    Adam's first update is about the sign of each gradient, so a tiny one flips it whole.
    tests/model/test_fp8.py checks one product and its gradients on this mesh to float32 rounding."""
    configs = [bench.config("current", steps=1, devices=n) for n in (1, 8)]
    for c in configs:
        c.optim.warmup_steps = 0
    (one_loss, one), (eight_loss, eight) = (bench.run(c, 1, devices=jax.devices()[:n]) for c, n in zip(configs, (1, 8)))
    np.testing.assert_allclose(one_loss, eight_loss, rtol=1e-6)
    moments = [(a, b) for a, b in zip(leaves(one.opt_state), leaves(eight.opt_state)) if a.ndim >= 2]
    assert moments and max(rel_gap(a, b) for a, b in moments) < 2e-2
