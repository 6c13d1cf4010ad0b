"""Training under the failure modes of large runs, seen in the metrics: a planted bad batch's finite
loss spike is detected and rolled back (the run goes on as if it had skipped the batch), and z-loss
holds back the logits' normaliser (log Z) that the plain loss lets drift as the logits grow."""

import grain
import jax
import numpy as np
import pytest

from lm.config import base_config
from lm.store.checkpoint import Checkpointer
from lm.train.faults import FaultPolicy
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.setup import build_run

B, T, V = 8, 16, 32
BAD = 22  # the planted batch: its targets follow another rule than every other batch's


def batch_for(i: int) -> dict:
    """Rows counting up by one (mod V) from a random start; the planted batch counts by seven."""
    rng = np.random.default_rng(i)
    starts = rng.integers(0, V, (B, 1))
    tokens = (starts + np.arange(T + 1) * (7 if i == BAD else 1)) % V
    return dict(
        inputs=tokens[:, :-1].astype(np.int32),
        targets=tokens[:, 1:].astype(np.int32),
        loss_mask=np.ones((B, T), np.float32),
        segment_ids=np.ones((B, T), np.int32),
        positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
    )


def make(z_loss=0.0):
    c = base_config()
    c.model.update(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=T)
    c.optim.update(lr=1e-2, warmup_steps=0, z_loss=z_loss)
    c.train.update(batch_size=B, steps=100)
    c.data.seq_len = T
    return build_run(c, devices=jax.devices()[:1])


class Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, values):
        self.rows.append({"step": step} | values)


def train(run, tmp_path, total, policy):
    bs = run.batch_shardings()
    stream = iter(grain.MapDataset.range(1000).map(lambda i: batch_for(int(i))).to_iter_dataset())
    ckpt, rows = Checkpointer(tmp_path / "checkpoints", every_steps=4, keep=3), Rows()
    try:
        state, _ = run_loop(
            LoopSpec(total, 1, 0, B * T, 1.0, 1e12),
            run.init_state(0),
            run.train_step(),
            stream,
            lambda b: {k: jax.device_put(v, bs[k]) for k, v in b.items()},
            writer=rows,
            checkpointer=ckpt,
            faults=Faults(policy, None, run.abstract_state()),
            show_progress=False,
        )
    finally:
        ckpt.close()
    return state, rows.rows


@pytest.fixture(scope="module")
def plain():
    return make()


def test_a_planted_spike_is_rolled_back_and_the_run_goes_on_without_it(plain, tmp_path, capsys):
    policy = FaultPolicy(spike_window=8, spike_threshold=8.0)
    state, rows = train(plain, tmp_path, 28, policy)
    assert "loss spike at step 23" in capsys.readouterr().out  # the planted batch is step 23's
    # steps 1-20 read batches 0-19 (checkpoint at 20); step 23 spikes -> back to 20, skipping
    # batches 20-22; steps 21-28 then read batches 23-30
    assert {"step": 23, "rollback_to": 20, "skipped_steps": 0, "consecutive_bad": 0, "rollbacks": 1} in rows
    step, put = plain.train_step(), plain.batch_shardings()
    ref = plain.init_state(0)
    for i in [*range(20), *range(23, 31)]:
        ref, _ = step(ref, {k: jax.device_put(v, put[k]) for k, v in batch_for(i).items()})
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref.params))):
        np.testing.assert_array_equal(a, b)


def test_z_loss_holds_log_z_back_and_is_in_the_metrics(plain, tmp_path):
    policy = FaultPolicy()
    _, rows = train(plain, tmp_path / "plain", 30, policy)
    _, rows_z = train(make(z_loss=0.03), tmp_path / "z", 30, policy)
    series = lambda rs, k: [r[k] for r in rs if k in r]  # noqa: E731
    # both learn the pattern; without z-loss (log Z)^2 grows from log(V)^2 ~ 12 as the logits grow
    # (to ~43 by step 30), with it it levels off (~25)
    assert series(rows, "loss")[-1] < 0.5 and series(rows_z, "loss")[-1] < 0.5
    assert series(rows, "log_z_sq")[-1] > 3 * series(rows, "log_z_sq")[0]
    assert series(rows_z, "log_z_sq")[-1] < 0.7 * series(rows, "log_z_sq")[-1]
