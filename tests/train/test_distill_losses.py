"""Distillation divergences: each against a float64 numpy computation (temperatures, jsd betas),
jsd's beta = 0 / 1 limits, zero loss and zero gradient when the student is the teacher, non-negativity,
masked-out positions counting nowhere and leaking no NaN (value or gradient), -inf vocabulary
entries, top-1 agreement, and the refusal of bad settings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.train.distill_losses import DIVERGENCES, check_divergence, masked_divergence, token_divergence, top1_agreement

B, T, V = 2, 3, 7
SETTINGS = [
    ("forward_kl", 0.5),
    ("reverse_kl", 0.5),
    ("jsd", 0.1),
    ("jsd", 0.5),
    ("jsd", 0.9),
    ("jsd", 0.0),
    ("jsd", 1.0),
]


def logits(seed, scale=3.0, shape=(B, T, V)):
    return np.random.default_rng(seed).normal(scale=scale, size=shape).astype(np.float32)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(logp, logq):
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (logp - logq), 0.0).sum(-1)


def reference(s, t, kind, beta, temperature):
    ls = np_log_softmax(s.astype(np.float64) / temperature)
    lt = np_log_softmax(t.astype(np.float64) / temperature)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return np_kl(lt, ls)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return np_kl(ls, lt)
    with np.errstate(divide="ignore"):
        log_m = np.log(beta * np.exp(lt) + (1 - beta) * np.exp(ls))
    return beta * np_kl(lt, log_m) + (1 - beta) * np_kl(ls, log_m)


def close(actual, expected, scale=1.0):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=1e-5, atol=1e-6 * scale)


# ---- the formulas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_matches_numpy(kind, beta, temperature):
    s, t = logits(0), logits(1)
    got = token_divergence(jnp.array(s), jnp.array(t), kind, beta, temperature)
    assert got.shape == (B, T) and got.dtype == jnp.float32
    # float32 log-probs carry an absolute error proportional to the scaled logits
    close(got, reference(s, t, kind, beta, temperature), scale=max(1.0, np.abs(s).max() / temperature))


def test_low_precision_logits_computed_in_float32():
    s, t = logits(2), logits(3)
    got = token_divergence(jnp.array(s, jnp.bfloat16), jnp.array(t, jnp.bfloat16), "jsd")
    assert got.dtype == jnp.float32
    s16 = np.asarray(jnp.array(s, jnp.bfloat16), np.float32)
    t16 = np.asarray(jnp.array(t, jnp.bfloat16), np.float32)
    close(got, reference(s16, t16, "jsd", 0.5, 1.0), scale=np.abs(s16).max())


def test_jsd_limits_are_the_two_kls():
    s, t = jnp.array(logits(4)), jnp.array(logits(5))
    close(token_divergence(s, t, "jsd", beta=0.0), np.asarray(token_divergence(s, t, "forward_kl")))
    close(token_divergence(s, t, "jsd", beta=1.0), np.asarray(token_divergence(s, t, "reverse_kl")))
    # and the ordinary jsd is symmetric at beta = 0.5, neither of them
    close(token_divergence(s, t, "jsd"), np.asarray(token_divergence(t, s, "jsd")))
    assert not np.allclose(token_divergence(s, t, "forward_kl"), token_divergence(s, t, "reverse_kl"))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_student_equal_to_teacher_gives_zero_loss_and_gradient(kind, beta, temperature):
    x = jnp.array(logits(6))
    mask = jnp.ones((B, T))

    def loss(student):
        return masked_divergence(student, x, mask, kind, beta, temperature)[0]

    value, grad = jax.value_and_grad(loss)(x)
    np.testing.assert_allclose(float(value), 0.0, atol=1e-5)  # a sum over B * T positions
    np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-6)


@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_non_negative(kind, beta):
    for seed in range(5):
        s, t = jnp.array(logits(10 + seed, scale=5.0)), jnp.array(logits(20 + seed, scale=0.5))
        assert float(token_divergence(s, t, kind, beta).min()) >= -1e-6


# ---- masks and infinities ----------------------------------------------------------------------------

MASK = np.array([[1.0, 0.0, 1.0], [0.5, 1.0, 0.0]], np.float32)


@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_masked_positions_count_nowhere(kind, beta):
    s, t = logits(30), logits(31)
    div_sum, count = masked_divergence(jnp.array(s), jnp.array(t), jnp.array(MASK), kind, beta, 1.5)
    assert div_sum.dtype == jnp.float32 and div_sum.shape == () and count.shape == ()
    close(div_sum, (reference(s, t, kind, beta, 1.5) * MASK).sum(), scale=T * B * np.abs(s).max())
    close(count, MASK.sum())


@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_garbage_in_masked_positions_does_not_leak(kind, beta):
    s, t = logits(32), logits(33)
    dirty_s, dirty_t = s.copy(), t.copy()
    dirty_t[0, 1] = np.nan
    dirty_s[0, 1] = np.inf
    dirty_t[1, 2] = -np.inf
    dirty_s[1, 2, 3] = np.nan

    def loss(student, teacher):
        return masked_divergence(student, teacher, jnp.array(MASK), kind, beta)[0]

    clean, clean_grad = jax.value_and_grad(loss)(jnp.array(s), jnp.array(t))
    dirty, dirty_grad = jax.value_and_grad(loss)(jnp.array(dirty_s), jnp.array(dirty_t))
    assert np.isfinite(float(dirty)) and np.isfinite(np.asarray(dirty_grad)).all()
    close(dirty, float(clean), scale=np.abs(s).max())
    close(dirty_grad, np.asarray(clean_grad), scale=np.abs(s).max())
    np.testing.assert_allclose(np.asarray(dirty_grad)[MASK == 0], 0.0, atol=1e-6)


@pytest.mark.parametrize("kind,beta", SETTINGS)
def test_minus_inf_vocabulary_entry_gives_finite_values_and_gradients(kind, beta):
    s, t = logits(40), logits(41)
    s[..., 2] = -np.inf  # an entry masked out of both vocabularies
    t[..., 2] = -np.inf

    def loss(student):
        return masked_divergence(student, jnp.array(t), jnp.ones((B, T)), kind, beta)[0]

    value, grad = jax.value_and_grad(loss)(jnp.array(s))
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    close(value, reference(s, t, kind, beta, 1.0).sum(), scale=B * T * 10)
    np.testing.assert_allclose(np.asarray(grad)[..., 2], 0.0, atol=1e-6)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("jsd", 0.5), ("jsd", 0.9)])
def test_minus_inf_in_the_teacher_only(kind, beta):
    # where the teacher has no mass, forward KL and jsd stay finite (reverse KL is rightly infinite)
    s, t = logits(42), logits(43)
    t[..., 4] = -np.inf

    def loss(student):
        return masked_divergence(student, jnp.array(t), jnp.ones((B, T)), kind, beta)[0]

    value, grad = jax.value_and_grad(loss)(jnp.array(s))
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    close(value, reference(s, t, kind, beta, 1.0).sum(), scale=B * T * 10)


# ---- agreement and settings --------------------------------------------------------------------------


def test_top1_agreement():
    eye = np.eye(3, dtype=np.float32)
    student = jnp.array(eye[[0, 1, 2, 0]][None] * 2.0)  # argmaxes 0 1 2 0
    teacher = jnp.array(eye[[0, 2, 2, 1]][None] * 5.0)  # argmaxes 0 2 2 1
    agree, count = top1_agreement(student, teacher, jnp.array([[1.0, 1.0, 0.0, 1.0]]))
    assert agree.dtype == jnp.float32 and count.dtype == jnp.float32
    np.testing.assert_allclose([float(agree), float(count)], [1.0, 3.0], atol=1e-6)  # position 2 is out


@pytest.mark.parametrize(
    "kind,beta,temperature,word",
    [
        ("kl", 0.5, 1.0, "'kl'"),
        ("JSD", 0.5, 1.0, "'JSD'"),
        ("jsd", -0.1, 1.0, "-0.1"),
        ("jsd", 1.5, 1.0, "1.5"),
        ("jsd", math.nan, 1.0, "nan"),
        ("forward_kl", 0.5, 0.0, "0.0"),
        ("forward_kl", 0.5, -1.0, "-1.0"),
        ("forward_kl", 0.5, math.nan, "nan"),
        ("forward_kl", 0.5, math.inf, "inf"),
    ],
)
def test_check_divergence_refuses_bad_settings(kind, beta, temperature, word):
    with pytest.raises(ValueError, match=word) as err:
        check_divergence(kind, beta, temperature)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        token_divergence(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 2)), kind, beta, temperature)


def test_check_divergence_accepts_the_edges():
    for kind in DIVERGENCES:
        for beta in (0.0, 0.5, 1.0):
            check_divergence(kind, beta, 1e-3)
