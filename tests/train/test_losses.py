"""masked_cross_entropy and pretrain_loss against an independent numpy log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np

from lm.train.losses import masked_cross_entropy, pretrain_loss

# [B=2, T=3, V=4] hand-made logits: a large-magnitude row (stability), a uniform row, ties.
LOGITS = np.array(
    [
        [[2.0, 1.0, 0.0, -1.0], [100.0, 99.0, 98.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        [[-3.0, 4.0, 0.5, 0.5], [1.5, -2.0, 3.0, 0.0], [7.0, 7.0, -7.0, 1.0]],
    ],
    np.float32,
)
TARGETS = np.array([[0, 2, 3], [1, 0, 2]], np.int32)
MASK = np.array([[1, 1, 0], [1, 0, 1]], np.float32)


def np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_reference(logits, targets, mask):
    """(nll_sum, count, z_sum) in float64, written without the code under test."""
    x = logits.astype(np.float64)
    m = x.max(-1)
    log_z = m + np.log(np.exp(x - m[..., None]).sum(-1))
    logp = np_log_softmax(x)
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return (nll * mask).sum(), mask.sum(), (log_z**2 * mask).sum()


def test_hand_computed_single_position():
    # logits [0, ln 3] with target 1: p = 3/4, nll = ln(4/3); Z = 1 + 3 = 4.
    logits = jnp.array([[[0.0, np.log(3.0)]]], jnp.float32)
    nll, count, z = masked_cross_entropy(logits, jnp.array([[1]]), jnp.array([[1.0]]))
    np.testing.assert_allclose(float(nll), np.log(4 / 3), rtol=1e-6)
    assert float(count) == 1.0
    np.testing.assert_allclose(float(z), np.log(4.0) ** 2, rtol=1e-6)


def test_matches_numpy_log_softmax():
    nll, count, z = masked_cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(MASK))
    ref_nll, ref_count, ref_z = np_reference(LOGITS, TARGETS, MASK)
    assert float(count) == ref_count == 4.0
    np.testing.assert_allclose(float(nll), ref_nll, rtol=1e-6)
    np.testing.assert_allclose(float(z), ref_z, rtol=1e-6)
    # all-ones mask: every position counts
    ones = np.ones_like(MASK)
    nll, count, z = masked_cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(ones))
    ref_nll, _, ref_z = np_reference(LOGITS, TARGETS, ones)
    assert float(count) == 6.0
    np.testing.assert_allclose(float(nll), ref_nll, rtol=1e-6)
    np.testing.assert_allclose(float(z), ref_z, rtol=1e-6)


def test_gradient_is_softmax_minus_onehot_and_zero_where_masked():
    loss = lambda lg: masked_cross_entropy(lg, jnp.asarray(TARGETS), jnp.asarray(MASK))[0]
    grad = jax.grad(loss)(jnp.asarray(LOGITS))
    p = np.exp(np_log_softmax(LOGITS))
    onehot = np.eye(LOGITS.shape[-1])[TARGETS]
    np.testing.assert_allclose(np.asarray(grad), (p - onehot) * MASK[..., None], atol=1e-6)
    assert not np.any(np.asarray(grad)[MASK == 0])


def test_masked_positions_change_nothing_including_gradients():
    rng = np.random.default_rng(0)
    logits2, targets2 = LOGITS.copy(), TARGETS.copy()
    off = MASK == 0
    logits2[off] = rng.normal(size=logits2[off].shape) * 50.0
    targets2[off] = (TARGETS[off] + 1) % LOGITS.shape[-1]
    assert not np.array_equal(logits2, LOGITS) and not np.array_equal(targets2, TARGETS)

    def value_and_grads(logits, targets):
        f = lambda lg: sum(masked_cross_entropy(lg, jnp.asarray(targets), jnp.asarray(MASK))[i] for i in (0, 2))
        return jax.value_and_grad(f)(jnp.asarray(logits))

    out1 = masked_cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(MASK))
    out2 = masked_cross_entropy(jnp.asarray(logits2), jnp.asarray(targets2), jnp.asarray(MASK))
    for a, b in zip(out1, out2):
        assert float(a) == float(b)
    (v1, g1), (v2, g2) = value_and_grads(LOGITS, TARGETS), value_and_grads(logits2, targets2)
    assert float(v1) == float(v2)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    # and the control: changing an *unmasked* target does change the loss
    targets3 = TARGETS.copy()
    targets3[0, 0] = 1
    out3 = masked_cross_entropy(jnp.asarray(LOGITS), jnp.asarray(targets3), jnp.asarray(MASK))
    assert abs(float(out3[0]) - float(out1[0])) > 0.5


class _LogitsModel:
    """Stands in for the Transformer: 'params' are the logits themselves."""

    def apply(self, variables, inputs, segment_ids, positions):
        assert inputs.shape == segment_ids.shape == positions.shape
        return variables["params"]["logits"]


def test_pretrain_loss_objective_is_nll_plus_weighted_z_loss():
    batch = dict(
        inputs=np.zeros_like(TARGETS),
        targets=TARGETS,
        loss_mask=MASK,
        segment_ids=np.ones_like(TARGETS),
        positions=np.zeros_like(TARGETS),
    )
    params = {"logits": jnp.asarray(LOGITS)}
    ref_nll, ref_count, ref_z = np_reference(LOGITS, TARGETS, MASK)
    for z_loss in (0.0, 1e-2):
        objective, sums = pretrain_loss(_LogitsModel(), z_loss=z_loss)(params, batch, {}, jax.random.PRNGKey(0))
        np.testing.assert_allclose(float(objective), ref_nll + z_loss * ref_z, rtol=1e-6)
        np.testing.assert_allclose(float(sums["loss_sum"]), ref_nll, rtol=1e-6)
        np.testing.assert_allclose(float(sums["log_z_sq_sum"]), ref_z, rtol=1e-6)
        assert float(sums["count"]) == ref_count


def test_out_of_range_targets_under_mask_zero_are_ignored():
    # a padding sentinel such as vocab_size where loss_mask is 0 must not turn the sum into NaN
    targets = TARGETS.copy()
    targets[MASK == 0] = LOGITS.shape[-1]
    out = masked_cross_entropy(jnp.asarray(LOGITS), jnp.asarray(targets), jnp.asarray(MASK))
    ref_nll, ref_count, ref_z = np_reference(LOGITS, TARGETS, MASK)
    np.testing.assert_allclose([float(x) for x in out], [ref_nll, ref_count, ref_z], rtol=1e-6)
    loss = lambda lg: masked_cross_entropy(lg, jnp.asarray(targets), jnp.asarray(MASK))[0]
    grad = jax.grad(loss)(jnp.asarray(LOGITS))
    assert np.all(np.isfinite(np.asarray(grad)))
    assert not np.any(np.asarray(grad)[MASK == 0])
