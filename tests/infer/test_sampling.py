"""Token choice: the filters against hand-built distributions, and top-k=1 == greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.errors import UserError
from lm.infer.sampling import SamplingParams, choose, filter_logits

# probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 over six tokens, in a shuffled order
PROBS = np.array([0.1, 0.4, 0.04, 0.15, 0.25, 0.06])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


def kept(params):
    return set(np.flatnonzero(np.isfinite(np.asarray(filter_logits(LOGITS, params)[0]))).tolist())


def test_filters_keep_exactly_the_hand_computed_sets():
    assert kept(SamplingParams(top_k=2)) == {1, 4}
    # nucleus: 0.4 < 0.6, 0.4 + 0.25 = 0.65 >= 0.6 -> the two likeliest
    assert kept(SamplingParams(top_p=0.6)) == {1, 4}
    assert kept(SamplingParams(top_p=0.66)) == {1, 4, 3}
    assert kept(SamplingParams(top_p=0.3)) == {1}
    # min-p 0.3: p >= 0.3 * 0.4 = 0.12
    assert kept(SamplingParams(min_p=0.3)) == {1, 4, 3}
    assert kept(SamplingParams(top_k=3, min_p=0.5)) == {1, 4}
    assert kept(SamplingParams()) == set(range(6))


def draws(params, n=4000):
    keys = jax.random.split(jax.random.PRNGKey(params.seed), n)
    tokens = jax.vmap(lambda k: choose(k, LOGITS, params)[0][0])(keys)
    return np.bincount(np.asarray(tokens), minlength=6)


def test_top_p_never_samples_outside_the_nucleus_and_follows_the_renormalised_distribution():
    counts = draws(SamplingParams(top_p=0.66, seed=3))
    assert counts[[0, 2, 5]].sum() == 0  # outside the nucleus {1, 4, 3}: never
    expected = np.array([0.4, 0.25, 0.15]) / 0.8 * counts.sum()
    np.testing.assert_allclose(counts[[1, 4, 3]], expected, rtol=0.08)


def test_min_p_and_temperature():
    counts = draws(SamplingParams(min_p=0.3, seed=1))
    assert counts[[0, 2, 5]].sum() == 0
    cold = draws(SamplingParams(temperature=0.25, seed=2))  # p^4, renormalised: token 1 dominates
    p4 = PROBS**4 / (PROBS**4).sum()
    np.testing.assert_allclose(cold / cold.sum(), p4, atol=0.02)


def test_top_k_one_is_greedy_and_logprobs_are_the_models():
    logits = jax.random.normal(jax.random.PRNGKey(0), (5, 50))
    greedy, lp_g = choose(jax.random.PRNGKey(1), logits, SamplingParams(temperature=0))
    top1, lp_1 = choose(jax.random.PRNGKey(1), logits, SamplingParams(top_k=1, temperature=1.7))
    np.testing.assert_array_equal(greedy, top1)
    np.testing.assert_array_equal(greedy, np.argmax(logits, -1))
    filtered = filter_logits(logits, SamplingParams(top_k=1, temperature=1.7))  # the sampling path itself
    np.testing.assert_array_equal(jax.random.categorical(jax.random.PRNGKey(5), filtered), greedy)
    expected = jax.nn.log_softmax(logits)[np.arange(5), np.asarray(greedy)]
    np.testing.assert_allclose(lp_g, expected, rtol=1e-6)
    # the reported log-prob is the model's, not the filtered distribution's (which would be 0)
    np.testing.assert_allclose(lp_1, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(min_p=1.0), "min_p"),
    ],
)
def test_bad_settings_name_the_setting(kw, key):
    with pytest.raises(UserError, match=key):
        SamplingParams(**kw)
