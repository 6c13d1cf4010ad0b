"""Numerical faults: non-finite steps leave no trace, counters, spike detection, and the loop's
rollback (restore the last good checkpoint, skip ahead in the data) or stop."""

import math
import sys

import grain
import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.errors import UserError
from lm.store.checkpoint import Checkpointer
from lm.train.faults import FaultPolicy, Health, robust_spike
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.setup import build_run

B, T, V = 4, 8, 32


def batch_for(i: int, poisoned: frozenset = frozenset()) -> dict:
    """Batch i of a fixed stream; a poisoned batch carries one NaN in its loss mask."""
    rng = np.random.default_rng(i)
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    mask = np.ones((B, T), np.float32)
    if i in poisoned:
        mask[1, 3] = np.nan
    return dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        loss_mask=mask,
        segment_ids=np.ones((B, T), np.int32),
        positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
    )


class Setup:
    def __init__(self):
        c = base_config()
        c.model.update(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=T)
        c.optim.update(lr=1e-2, warmup_steps=0)
        c.train.update(batch_size=B, steps=100)
        c.data.seq_len = T
        run = build_run(c, devices=jax.devices()[:1])
        self.mesh, self.shardings = run.mesh, run.state_shardings
        self.host_state = jax.device_get(run.init_state(0))
        self.abstract = run.abstract_state()
        self.bs = run.batch_shardings()
        self.step_fn = run.train_step()

    def state(self):
        return jax.device_put(self.host_state, self.shardings)

    def put(self, batch):
        return {k: jax.device_put(v, self.bs[k]) for k, v in batch.items()}


@pytest.fixture(scope="module")
def setup():
    return Setup()


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_non_finite_step_leaves_params_and_optimizer_unchanged(setup):
    state, m0 = setup.step_fn(setup.state(), setup.put(batch_for(0)))
    before = jax.device_get(state)
    assert float(m0["update_skipped"]) == 0.0
    state, m1 = setup.step_fn(state, setup.put(batch_for(1, frozenset({1}))))
    after = jax.device_get(state)
    assert math.isnan(float(m1["loss"])) and float(m1["update_skipped"]) == 1.0
    assert_same(after.params, before.params)
    assert_same(after.opt_state, before.opt_state)  # Adam moments and count untouched
    assert int(after.step) == int(before.step) + 1  # the batch was consumed
    # a good batch afterwards trains exactly as if the bad one had never been seen
    state, m2 = setup.step_fn(state, setup.put(batch_for(2)))
    direct = jax.device_put(before.replace(step=np.int32(2), rng=after.rng), setup.shardings)
    ref, _ = setup.step_fn(direct, setup.put(batch_for(2)))
    assert float(m2["update_skipped"]) == 0.0
    assert_same(jax.device_get(state).params, jax.device_get(ref).params)


def test_health_counts_bad_steps_and_decides():
    h = Health(FaultPolicy(max_bad_steps=3, on_bad="restore", max_rollbacks=1))
    assert h.observe(1, 2.0, False) is None
    assert h.observe(2, float("nan"), True) is None
    assert h.observe(3, float("nan"), True) is None
    assert h.metrics() == {"skipped_steps": 2, "consecutive_bad": 2, "rollbacks": 0}
    assert h.observe(4, 2.0, False) is None and h.consecutive_bad == 0  # a good step ends the streak
    verdicts = [h.observe(s, float("nan"), True) for s in (5, 6, 7)]
    assert verdicts[:2] == [None, None] and verdicts[2].action == "restore"
    assert "3 consecutive steps" in verdicts[2].reason and "step 7" in verdicts[2].reason
    h.rolled_back()
    assert h.metrics() == {"skipped_steps": 5, "consecutive_bad": 0, "rollbacks": 1}
    again = [h.observe(s, float("nan"), True) for s in (8, 9, 10)][-1]
    assert again.action == "stop" and "train.max_rollbacks" in again.reason
    stopper = Health(FaultPolicy(max_bad_steps=1, on_bad="stop"))
    assert stopper.observe(1, float("inf"), True).action == "stop"


def test_spike_uses_median_and_mad():
    window = [3.0, 3.1, 2.9, 3.2, 2.8, 3.0, 3.05, 2.95]
    # median 3.0; |dev| = 0,.1,.1,.2,.2,0,.05,.05 -> MAD 0.075; robust std 1.4826 * 0.075
    spike, median, std = robust_spike(window, 4.0, 8.0)
    assert median == pytest.approx(3.0) and std == pytest.approx(1.4826 * 0.075)
    assert spike == (4.0 > 3.0 + 8.0 * 1.4826 * 0.075)
    assert not robust_spike(window, 3.8, 8.0)[0]
    h = Health(FaultPolicy(spike_window=8, spike_threshold=8.0, on_bad="stop"))
    for i, loss in enumerate(window):
        assert h.observe(i + 1, loss, False) is None  # the window fills first
    assert h.observe(9, 3.5, False) is None
    v = h.observe(10, 9.0, False)
    assert v.action == "stop" and "loss spike at step 10" in v.reason
    assert 9.0 not in h.losses  # a spike does not pollute the window


class Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, values):
        self.rows.append({"step": step} | values)


def stream(poisoned):
    return iter(grain.MapDataset.range(1000).map(lambda i: batch_for(int(i), poisoned)).to_iter_dataset())


def run(setup, tmp_path, poisoned, policy, total=10):
    spec = LoopSpec(total, 1, 0, B * T, 1.0, 1e12)
    ckpt = Checkpointer(tmp_path / "checkpoints", every_steps=2, keep=3)
    rows = Rows()
    try:
        state, last = run_loop(
            spec,
            setup.state(),
            setup.step_fn,
            stream(poisoned),
            setup.put,
            writer=rows,
            checkpointer=ckpt,
            faults=Faults(policy, None, setup.abstract),
            show_progress=False,
        )
    finally:
        ckpt.close()
    return state, last, rows.rows, ckpt


def test_loop_rolls_back_and_skips_the_bad_batches(setup, tmp_path):
    state, last, rows, ckpt = run(setup, tmp_path, frozenset({4, 5}), FaultPolicy(max_bad_steps=2))
    # steps 1-4 use batches 0-3 (checkpoint at 4); batches 4 and 5 are bad -> back to step 4;
    # steps 5..10 then use batches 6..11
    ref = setup.state()
    for i in [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]:
        ref, _ = setup.step_fn(ref, setup.put(batch_for(i)))
    assert_same(jax.device_get(state).params, jax.device_get(ref).params)
    assert int(state.step) == 10
    assert {"step": 6, "rollback_to": 4, "skipped_steps": 2, "consecutive_bad": 0, "rollbacks": 1} in rows
    bad = [r for r in rows if r.get("update_skipped") == 1.0]
    assert [(r["step"], r["consecutive_bad"]) for r in bad] == [(5, 1), (6, 2)]
    assert last["skipped_steps"] == 2 and last["rollbacks"] == 1
    assert ckpt.all_steps() == [6, 8, 10]


def test_loop_stops_with_a_clear_message(setup, tmp_path):
    with pytest.raises(UserError, match="2 consecutive steps with non-finite loss.*train.max_bad_steps=2"):
        run(setup, tmp_path, frozenset({2, 3}), FaultPolicy(max_bad_steps=2, on_bad="stop"))
    assert Checkpointer(tmp_path / "checkpoints", 2, 3).all_steps() == [2]  # nothing saved past the trouble


def test_isolated_bad_steps_are_only_counted(setup, tmp_path):
    state, last, rows, _ = run(setup, tmp_path, frozenset({2, 6}), FaultPolicy(max_bad_steps=2), total=8)
    ref = setup.state()
    for i in range(8):
        ref, _ = setup.step_fn(ref, setup.put(batch_for(i, frozenset({2, 6}))))
    assert_same(jax.device_get(state).params, jax.device_get(ref).params)
    assert last["skipped_steps"] == 2 and last["rollbacks"] == 0
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 0, 1, 1, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "override,words",
    [
        ("train.on_bad=retry", "train.on_bad"),
        ("train.max_bad_steps=0", "train.max_bad_steps"),
        ("train.spike_window=3", "train.spike_window"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"),
        ("checkpoint.keep_period=-2", "checkpoint.keep_period"),
        ("checkpoint.agree_every_steps=0", "checkpoint.agree_every_steps"),
    ],
)
def test_fault_config_keys_are_validated(override, words):
    from lm.config import load_config

    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        load_config(None, [override])
    policy = FaultPolicy.from_config(load_config(None, ["train.on_bad=stop", "train.spike_window=50"]).train)
    assert policy.on_bad == "stop" and policy.spike_window == 50


def test_a_signal_stops_at_once_outside_the_loop_and_at_a_step_inside_it():
    import os
    import signal
    import time

    from lm.train.faults import StopRequested, StopSignal

    before = signal.getsignal(signal.SIGTERM)
    with StopSignal("start-up", defer=False, saved=False) as stop:
        stop.enter("data preparation")
        with pytest.raises(StopRequested) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # never reached: the handler raises as the signal arrives
        assert str(stopped.value) == "stopped by SIGTERM during data preparation; nothing is lost"
        assert not stopped.value.saved and not isinstance(stopped.value, Exception)  # no `except Exception` eats it
    assert signal.getsignal(signal.SIGTERM) is before

    with StopSignal("start-up", defer=False, saved=False) as stop:
        with StopSignal() as inner:  # a stage or the loop inside a command: one handler, one flag
            assert inner is stop and StopSignal.active is stop
        stop.enter("training", defer=True, saved=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.received == "SIGTERM"  # deferred: the loop stops at its next step, with a checkpoint
        # a signal the loop did not act on (it came after the last step) stops the run at the next phase
        with pytest.raises(StopRequested, match="during training; the training is saved") as stopped:
            stop.enter("the end-of-run evaluation", saved=True)
        assert stopped.value.saved
    assert signal.getsignal(signal.SIGTERM) is before and StopSignal.active is None


def test_a_stop_python_must_drop_is_not_printed_but_other_errors_are():
    """A stop raised inside a gc callback or __del__ is dropped by Python: no traceback for it (the
    next phase stops the run), while any other dropped error is still reported."""
    from lm.train.faults import StopRequested, StopSignal

    class Drops:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    reported = []
    before, sys.unraisablehook = sys.unraisablehook, lambda u: reported.append(u.exc_value)
    try:
        with StopSignal("start-up", defer=False, saved=False):
            Drops(StopRequested("SIGTERM", "start-up", False))
            Drops(ValueError("a real bug"))
        assert sys.unraisablehook is not before  # ours again, the recorder above
    finally:
        sys.unraisablehook = before
    assert [type(e) for e in reported] == [ValueError]
