"""The pure pieces of speculative decoding: the rejection sampler's emitted tokens distributed as
the target's whatever the draft's distribution (a model's or a point mass), counted; and
prompt-lookup drafts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.infer.spec_verify import accept_drafts, ngram_drafts
from tests.infer.engine.test_draft_engine import chi_square

V, K, DRAWS = 6, 2, 20_000
P = jnp.asarray(
    [[0.05, 0.40, 0.05, 0.20, 0.25, 0.05], [0.30, 0.10, 0.10, 0.10, 0.10, 0.30], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]
)
Q_MODEL = jnp.asarray([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10], [0.05, 0.05, 0.30, 0.30, 0.25, 0.05]])
Q_POINT = jax.nn.one_hot(jnp.asarray([1, 5]), V)  # an n-gram draft: a point mass
CRITICAL = 20.5  # chi-square with 5 degrees of freedom at p = 0.001


def faithful(key, p, q):
    key_draft, key_accept = jax.random.split(key)
    drafts = jax.random.categorical(key_draft, jnp.log(q), axis=-1).astype(jnp.int32)
    n_acc, following = accept_drafts(key_accept, p, q, drafts, jnp.int32(K))
    return jnp.concatenate([drafts, following[None]]).at[n_acc].set(following), n_acc


def always_accepting(key, p, q):
    """What a broken sampler emits: the drafts as they are."""
    drafts = jax.random.categorical(jax.random.split(key)[0], jnp.log(q), axis=-1).astype(jnp.int32)
    return jnp.concatenate([drafts, drafts[:1]]), jnp.int32(K)


def counted(tokens) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=V)


@functools.cache
def draws(sampler):
    return jax.jit(jax.vmap(sampler, in_axes=(0, None, None)))


def emitted(sampler, q):
    tokens, n_acc = draws(sampler)(jax.random.split(jax.random.PRNGKey(0), DRAWS), P, q)
    return np.asarray(tokens), np.asarray(n_acc)


@pytest.mark.parametrize("q", [Q_MODEL, Q_POINT], ids=["model", "point"])
def test_rejection_sampling_emits_the_target_distribution(q):
    tokens, n_acc = emitted(faithful, q)
    p = np.asarray(P, np.float64)
    assert chi_square(counted(tokens[:, 0]), p[0]) < CRITICAL  # the first token, kept draft or resampled
    second = tokens[n_acc >= 1, 1]  # after a kept first draft, the next token follows p[1]
    assert len(second) > 2_000 and chi_square(counted(second), p[1]) < CRITICAL
    wrong, _ = emitted(always_accepting, q)  # the same check catches a sampler that keeps every draft
    assert chi_square(counted(wrong[:, 0]), p[0]) > 10 * CRITICAL


def test_no_valid_draft_samples_the_target_and_an_equal_draft_is_always_kept():
    keys = jax.random.split(jax.random.PRNGKey(1), DRAWS)
    drafts = jnp.asarray([2, 2], jnp.int32)
    n_acc, tokens = jax.vmap(lambda k: accept_drafts(k, P, Q_MODEL, drafts, jnp.int32(0)))(keys)
    assert not np.any(n_acc) and chi_square(counted(tokens), np.asarray(P[0], np.float64)) < CRITICAL
    n_acc, _ = jax.vmap(lambda k: accept_drafts(k, P, P[:K], drafts, jnp.int32(K)))(keys)
    assert np.all(np.asarray(n_acc) == K)


@pytest.mark.parametrize(
    "context, k, drafts",
    [
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, [7, 5, 1]),  # the most recent match of the last 3
        ([4, 2, 3, 8, 6, 6, 2, 3], 2, [8, 6]),  # the last 2 tokens when the last 3 have no match
        ([5, 8, 1, 5], 4, [8, 1, 5, 8]),  # the last token alone; at the end the text repeats: 8 1 5 again
        ([7, 3, 3, 3, 3], 4, [3, 3, 3, 3]),  # a run of one token drafts more of it
        ([1, 2, 3, 4], 2, None),  # no earlier occurrence: no drafts
    ],
)
def test_prompt_lookup_proposes_what_followed_the_latest_match(context, k, drafts):
    buffer = jnp.asarray(context + [9] * 6, jnp.int32)  # past the length: never drafted
    got, valid = jax.jit(ngram_drafts, static_argnums=2)(buffer, jnp.int32(len(context)), k)
    assert int(valid) == (k if drafts else 0)
    if drafts:
        assert np.asarray(got).tolist() == drafts
