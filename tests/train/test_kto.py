"""KTO: the loss against the paper's / TRL's equations on the same numbers, the KL estimate from
mismatched pairs (clamped at 0, no gradient, padding left out), a step through the model against
numpy over its own log-probs (live and precomputed reference alike), and a (2,2,2) mesh equal to
one device."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config
from lm.config.kto import KtoSettings
from lm.data.chat import ChatTemplate
from lm.data.tokenizer import ByteTokenizer
from lm.model.apply import sequence_logprobs
from lm.train.dpo import reference_logps
from lm.train.kto import LABEL, build_kto_run, kl_estimate, kto_terms
from lm.train.setup import build_run
from tests.train.test_pair_losses import _Rows

T, V = 64, 264
# (prompt, completion, desirable); each example's twin takes the completion before it
EXAMPLES = [("sort 312", "123", True), ("sort 90", "90", False), ("sort 5521", "1255", True), ("sort 77", "777", False)]


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def settings(**kw):
    return dataclasses.replace(KtoSettings.from_config(base_config().kto), **kw)


def test_the_loss_is_trls_on_the_same_numbers():
    logp, ref = np.array([-3.0, -5.0, -2.0]), np.array([-4.0, -4.0, -2.5])
    label, kl, beta, wd, wu = np.array([True, False, True]), 0.3, 0.5, 1.5, 0.8
    loss, rewards = kto_terms(settings(beta=beta, desirable_weight=wd, undesirable_weight=wu), logp, ref, kl, label)
    r = logp - ref  # chosen_logratios / rejected_logratios in TRL
    expected = [
        wd * (1 - sigmoid(beta * (r[0] - kl))),
        wu * (1 - sigmoid(beta * (kl - r[1]))),
        wd * (1 - sigmoid(beta * (r[2] - kl))),
    ]
    np.testing.assert_allclose(np.asarray(loss), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rewards), beta * r, rtol=1e-6)


def test_the_kl_estimate_is_clamped_has_no_gradient_and_leaves_padding_out():
    logp, ref = jnp.array([-3.0, -1.0, -7.0]), jnp.array([-4.0, -1.5, 0.0])
    valid = jnp.array([True, True, False])  # the third is a padding row: its -7 must not count
    assert float(kl_estimate(logp, ref, valid)) == pytest.approx((1.0 + 0.5) / 2)
    assert float(kl_estimate(ref, logp, valid)) == 0.0  # a negative mean is clamped
    grad = jax.grad(lambda x: kl_estimate(x, ref, valid))(logp)
    assert np.all(np.asarray(grad) == 0)


def config(examples=4, **kto):
    c = base_config()
    c.model.update(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T)
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)
    c.train.update(batch_size=examples, steps=10)
    c.data.seq_len = T
    c.kto.update(kto)
    return c


def kto_batch(repeat: int = 1):
    """EXAMPLES with their twins as [B, 2, T] rows (byte tokenizer) and labels."""
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    rows = EXAMPLES * repeat
    b = len(rows)
    batch = {k: np.zeros((b, 2, T), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((b, 2, T), np.float32)
    batch["label"] = np.array([float(d) for _, _, d in rows], np.float32)
    for i, (prompt, completion, _) in enumerate(rows):
        for side, answer in enumerate((completion, rows[i - 1][1])):
            ids, w = template.render([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
            n = len(ids) - 1
            batch["inputs"][i, side, :n], batch["targets"][i, side, :n] = ids[:-1], ids[1:]
            batch["loss_mask"][i, side, :n] = w[1:]
            batch["segment_ids"][i, side, :n], batch["positions"][i, side, :n] = 1, np.arange(n)
    return batch


@pytest.fixture(scope="module")
def base():
    return jax.device_get(build_run(config()).init_state(seed=11).params)


def kto_step(c, batch, base, policy=None, devices=None, extra=None):
    run = build_kto_run(c, devices=devices or jax.devices()[:1])
    state, frozen = run.init(seed=3, base=base)
    if policy is not None:
        state = state.replace(params=jax.device_put(policy, run.state_shardings.params))
    signature = run.signature(len(batch["inputs"]), pairs=True, extra=LABEL | (extra or {}))
    step = run.bind(run.train_step(signature), frozen)
    state, metrics = step(state, run.placer(signature).from_global(batch))
    return jax.device_get(state.params), jax.device_get(metrics), run


def logprobs(run, params, batch):
    logits = run.model.apply(
        {"params": params}, *(batch[k].reshape(-1, T) for k in ("inputs", "segment_ids", "positions"))
    )
    logp, _ = sequence_logprobs(logits, batch["targets"].reshape(-1, T), batch["loss_mask"].reshape(-1, T))
    return np.asarray(logp, np.float64).reshape(-1, 2)


def test_a_step_is_numpy_over_the_models_log_probs_with_a_live_or_a_precomputed_reference(base):
    batch = kto_batch()
    at_start, m0, _ = kto_step(config(), batch, base)
    assert float(m0["loss"]) == pytest.approx(0.5, abs=1e-5) and abs(float(m0["kl"])) < 1e-5  # policy = reference
    policy = jax.tree.map(lambda x: x * 1.05, base)  # a policy away from the reference
    c = config(beta=0.5, desirable_weight=1.2)
    _, m, run = kto_step(c, batch, base, policy=policy)
    pol, ref = logprobs(run, policy, batch), logprobs(run, base, batch)
    kl = max(0.0, float(np.mean(pol[:, 1] - ref[:, 1])))
    r, desirable = pol[:, 0] - ref[:, 0], batch["label"] > 0.5
    losses = [1.2 * (1 - sigmoid(0.5 * (x - kl))) if d else 1 - sigmoid(0.5 * (kl - x)) for x, d in zip(r, desirable)]
    scale = 1e-5 * np.abs(pol).mean()  # differences of summed log-probs round with their magnitude
    assert float(m["kl"]) == pytest.approx(kl, abs=scale)
    assert float(m["loss"]) == pytest.approx(np.mean(losses), rel=1e-5, abs=scale)
    assert float(m["rewards/chosen"]) == pytest.approx(0.5 * r[desirable].mean(), abs=scale)
    assert float(m["rewards/rejected"]) == pytest.approx(0.5 * r[~desirable].mean(), abs=scale)
    assert float(m["logps/chosen"]) == pytest.approx(pol[desirable, 0].mean(), rel=1e-5)
    assert (float(m["count/chosen"]), float(m["count/rejected"])) == (2.0, 2.0)
    pre = config(beta=0.5, desirable_weight=1.2, reference="precomputed")
    pre_run = build_kto_run(pre, devices=jax.devices()[:1])
    with_ref = batch | {"ref_logps": reference_logps(pre_run, base, _Rows(batch), 2)}
    _, m_pre, _ = kto_step(pre, with_ref, base, policy=policy, extra={"ref_logps": ((2,), np.float32)})
    for k in ("loss", "kl", "rewards/chosen", "grad_norm"):
        assert float(m_pre[k]) == pytest.approx(float(m[k]), rel=1e-5, abs=1e-6), k


def test_kto_on_a_2x2x2_mesh_equals_one_device(base):
    c8 = config(examples=8)
    c8.mesh.update(data=2, fsdp=2, tensor=2)
    batch = kto_batch(repeat=2)
    policy = jax.tree.map(lambda x: x * 1.05, base)
    one, m1, _ = kto_step(config(examples=8), batch, base, policy=policy)
    eight, m8, _ = kto_step(c8, batch, base, policy=policy, devices=jax.devices()[:8])
    assert float(m8["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    # the estimate is a difference of summed log-probs: its rounding scales with their magnitude
    scale = 1e-5 * abs(float(m1["logps/chosen"]))
    assert float(m8["kl"]) == pytest.approx(float(m1["kl"]), abs=scale)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one, eight)
