"""The jitted train step on a single-device mesh: initial loss, exact gradient accumulation,
masked tokens, overfitting a tiny batch, metrics. Compiles are the slow part, so each step
function is built once per module and states are re-created from a host copy."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.config import base_config
from lm.model.transformer import Transformer
from lm.train.setup import build_run
from lm.train.state import TrainState, state_shardings
from lm.train.steps import make_train_step

B, T, V = 8, 16, 64
OVERFIT_STEPS = 100


def config():
    c = base_config()
    c.model.update(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=T)
    c.optim.update(lr=1e-2, warmup_steps=10, min_lr_ratio=0.1)
    c.train.update(batch_size=B, steps=OVERFIT_STEPS, micro_batches=2)
    c.data.seq_len = T
    return c


def make_batch(seed=0, mask=None, n_docs=1):
    """Random token rows (targets = inputs shifted), optionally packed with n_docs documents per row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    if n_docs > 1:
        bounds = np.linspace(0, T, n_docs + 1).astype(int)
        for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[:, a:b] = d + 1
            pos[:, a:b] = np.arange(b - a)
    return dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        loss_mask=np.ones((B, T), np.float32) if mask is None else mask.astype(np.float32),
        segment_ids=seg,
        positions=pos,
    )


class Setup:
    def __init__(self):
        c = config()
        self.config = c
        run = build_run(c, devices=jax.devices()[:1])
        self.run, self.mesh, self.rules, self.model = run, run.mesh, run.rules, run.model
        self.plain_model = Transformer(run.spec)  # no mesh: the reference
        self.bs = run.batch_shardings()
        self.adamw, self.schedule, self.adamw_shardings = run.optimizer, run.schedule, run.state_shardings
        self.host_state = jax.device_get(run.init_state(0))  # a host copy: the step donates device states
        self.loss_fn = run.loss_fn
        self.adamw_step = run.train_step()
        # Plain gradient descent with lr 1: the update *is* minus the (normalised) gradient, so comparing
        # params compares gradients (Adam's first step is ~sign(g) and would hide scale errors).
        self.sgd = optax.identity()
        self.sgd_shardings = state_shardings(self.model, self.sgd, self.mesh, self.rules)[0]
        self.sgd_steps = {
            n: make_train_step(
                self.loss_fn, self.sgd, optax.constant_schedule(1.0), self.mesh, self.sgd_shardings, self.bs, n_micro=n
            )
            for n in (1, 4)
        }

    @property
    def params0(self):
        return self.host_state.params

    def sgd_state(self):
        host = TrainState(
            step=self.host_state.step,
            params=self.params0,
            opt_state=self.sgd.init(self.params0),
            rng=self.host_state.rng,
        )
        return jax.device_put(host, self.sgd_shardings)

    def adamw_state(self):
        return jax.device_put(self.host_state, self.adamw_shardings)

    def put(self, batch):
        return {k: jax.device_put(v, self.bs[k]) for k, v in batch.items()}

    def sgd_update(self, batch, n_micro):
        state, metrics = self.sgd_steps[n_micro](self.sgd_state(), self.put(batch))
        return jax.device_get(state.params), jax.device_get(metrics)


@pytest.fixture(scope="module")
def setup():
    return Setup()


def reference_grads(setup, batch, rows=slice(None)):
    """d/dparams of (sum of masked token NLL / number of loss tokens) over `rows`, written
    independently of lm.train (plain model, jax.nn.log_softmax)."""
    b = {k: jnp.asarray(v[rows]) for k, v in batch.items()}
    return jax.device_get(_mean_nll_grad(setup.plain_model)(jax.tree.map(jnp.asarray, setup.params0), b))


@functools.cache
def _mean_nll_grad(model):
    def mean_nll(params, b):
        logits = model.apply({"params": params}, b["inputs"], b["segment_ids"], b["positions"])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b["targets"][..., None], -1)[..., 0]
        return -jnp.sum(logp * b["loss_mask"]) / jnp.sum(b["loss_mask"])

    return jax.jit(jax.grad(mean_nll))


def max_abs_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def max_rel_diff(a, b):
    """The largest difference of two trees, each leaf's relative to the largest magnitude in it:
    float32 sums taken in another order (micro-batches, another processor's kernels) differ by
    a few units in the last place of the values summed, whatever their size."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) / max(float(np.max(np.abs(np.asarray(y)))), 1e-30)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def uneven_mask():
    """Rows with very different numbers of loss tokens. Micro-batch i of 4 holds rows i and i+4
    (interleaved), so the micro-batches carry 32, 2, 7 and 20 loss tokens."""
    counts = [16, 1, 3, 12, 16, 1, 4, 8]
    mask = np.zeros((B, T), np.float32)
    for r, n in enumerate(counts):
        mask[r, T - n :] = 1.0
    return mask


# ---- (a) initial loss --------------------------------------------------------------------------


def test_untrained_loss_is_log_vocab(setup):
    _, metrics = setup.sgd_update(make_batch(seed=1), 1)
    assert abs(float(metrics["loss"]) - math.log(V)) < 0.15
    assert float(metrics["tokens"]) == B * T


# ---- (b) gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize("uneven", [False, True], ids=["full_mask", "uneven_mask"])
def test_accumulation_matches_single_batch(setup, uneven):
    batch = make_batch(seed=2, mask=uneven_mask() if uneven else None, n_docs=2)
    p1, m1 = setup.sgd_update(batch, 1)
    p4, m4 = setup.sgd_update(batch, 4)
    assert max_rel_diff(p1, p4) < 1e-5
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)  # a mean of B*T terms, summed in 1 or 4 parts
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    assert float(m4["tokens"]) == batch["loss_mask"].sum()

    # Independent reference: with SGD(lr=1), new params = params0 - grad(global token mean).
    g = reference_grads(setup, batch)
    expected = jax.tree.map(lambda p, gi: p - gi, setup.params0, g)
    assert max_rel_diff(p4, expected) < 1e-5
    grad_norm = math.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(g)))
    np.testing.assert_allclose(m4["grad_norm"], grad_norm, rtol=1e-4)

    if uneven:
        # The test has teeth: averaging per-micro-batch means (rows i, i+4) would move params
        # by far more than the tolerance above.
        micro = [reference_grads(setup, batch, rows=np.arange(i, B, 4)) for i in range(4)]
        naive = jax.tree.map(lambda *gs: sum(gs) / 4, *micro)
        assert max_abs_diff(naive, g) > 1e-2


# ---- (c) masked tokens --------------------------------------------------------------------------


def test_masked_tokens_do_not_affect_the_update(setup):
    mask = np.ones((B, T), np.float32)
    mask[:, :3] = 0.0  # e.g. a prompt: inputs visible, targets not trained on
    mask[:, -4:] = 0.0  # padding at the end of each row
    batch = make_batch(seed=3, mask=mask)
    batch["segment_ids"][:, -4:] = 0  # padding is segment 0: nobody attends to it
    batch["positions"][:, -4:] = 0
    p_ref, m_ref = setup.sgd_update(batch, 1)

    other = {k: v.copy() for k, v in batch.items()}
    rng = np.random.default_rng(7)
    off = mask == 0
    other["targets"][off] = rng.integers(0, V, off.sum())
    other["inputs"][:, -4:] = rng.integers(0, V, (B, 4))  # padding tokens' content
    assert not np.array_equal(other["targets"], batch["targets"])
    p_other, m_other = setup.sgd_update(other, 1)
    assert max_rel_diff(p_ref, p_other) < 1e-6  # masked terms are zeros; their order may differ elsewhere
    assert float(m_ref["loss"]) == pytest.approx(float(m_other["loss"]), rel=1e-6)
    assert float(m_ref["tokens"]) == float(m_other["tokens"]) == mask.sum()

    # control: changing a target that *is* in the loss changes the update
    control = {k: v.copy() for k, v in batch.items()}
    control["targets"][0, 5] = (control["targets"][0, 5] + 1) % V
    p_control, _ = setup.sgd_update(control, 1)
    assert max_abs_diff(p_ref, p_control) > 1e-3


# ---- (d, e) overfitting, metrics and the step counter --------------------------------------------


@pytest.fixture(scope="module")
def overfit_run(setup):
    batch = setup.put(make_batch(seed=4, n_docs=2))
    state = setup.adamw_state()
    history = []
    params_after_first = None
    for i in range(OVERFIT_STEPS):
        state, metrics = setup.adamw_step(state, batch)
        history.append(dict(jax.device_get(metrics), step=int(state.step)))
        if i == 0:
            params_after_first = jax.device_get(state.params)
    return history, params_after_first


def test_overfits_a_tiny_batch(overfit_run):
    history, _ = overfit_run
    losses = [h["loss"] for h in history]
    assert abs(losses[0] - math.log(V)) < 0.15
    assert min(losses) < 0.5, losses[::10]
    assert losses[-1] < 0.5


def test_metrics_lr_follows_the_schedule_and_step_increments(setup, overfit_run):
    history, params_after_first = overfit_run
    o = setup.config.optim
    for i, h in enumerate(history):
        assert h["step"] == i + 1
        lr, w, end = o.lr, o.warmup_steps, o.lr * o.min_lr_ratio
        expected = (
            lr * i / w if i < w else end + (lr - end) * 0.5 * (1 + math.cos(math.pi * (i - w) / (OVERFIT_STEPS - w)))
        )
        np.testing.assert_allclose(h["lr"], expected, rtol=1e-5, atol=1e-12)
    assert history[0]["lr"] == 0.0
    # the reported lr is the one applied: at step 0 it is 0, so the params did not move
    assert max_abs_diff(params_after_first, setup.params0) == 0.0


def test_skipped_step_keeps_one_counter_for_applied_and_logged_lr(setup):
    """After a non-finite (skipped) step the schedule still advances with state.step, and the
    logged lr is the one applied: the next update is exactly -schedule(2) * gradient."""
    schedule = lambda s: 0.05 * (s + 1.0)  # noqa: E731  a different lr at every step
    step = make_train_step(setup.loss_fn, setup.sgd, schedule, setup.mesh, setup.sgd_shardings, setup.bs)
    good, bad = make_batch(seed=8), make_batch(seed=9)
    bad["loss_mask"][2, 5] = np.nan
    state, m0 = step(setup.sgd_state(), setup.put(good))
    state, m1 = step(state, setup.put(bad))
    assert float(m1["update_skipped"]) == 1.0 and int(state.step) == 2
    before = jax.device_get(state.params)
    state, m2 = step(state, setup.put(good))
    after = jax.device_get(state.params)
    assert float(m2["update_skipped"]) == 0.0
    np.testing.assert_allclose(m2["lr"], schedule(2), rtol=1e-6)  # not schedule(1): the skip counted
    g = jax.device_get(
        _mean_nll_grad(setup.plain_model)(
            jax.tree.map(jnp.asarray, before), {k: jnp.asarray(v) for k, v in good.items()}
        )
    )
    applied = jax.tree.map(lambda b, a, gi: (b - a) / np.where(gi == 0, 1, gi), before, after, g)
    big = [(x, gi) for x, gi in zip(jax.tree.leaves(applied), jax.tree.leaves(g))]
    ratios = np.concatenate([x[np.abs(gi) > 1e-3].ravel() for x, gi in big])
    assert ratios.size > 100
    np.testing.assert_allclose(ratios, float(m2["lr"]), rtol=2e-3)
