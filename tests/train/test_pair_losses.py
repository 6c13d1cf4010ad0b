"""Preference losses: each DPO variant and the Bradley-Terry loss against hand-computed values,
each loss's default beta, RPO's NLL per response or per token (under micro-batch splits too),
sequence log-probs over masked-in tokens only, and, through real steps of a tiny model: ln 2 at
step 0, live and precomputed references giving the same update, the micro-batch split and a
(2,2,2) mesh changing nothing, padding pairs counting nowhere, the reward read at the last token."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config, load_config
from lm.config.dpo import LOSS_BETA
from lm.data.chat import ChatTemplate
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.model.apply import last_real, sequence_logprobs, sequence_scores
from lm.train.dpo import build_dpo_run, reference_logps
from lm.train.pair_losses import DpoSettings, dpo_loss, dpo_terms, log_odds, orpo_metrics, reward_terms
from lm.train.pairs import PAIR_EXTRA
from lm.train.reward import build_reward_run
from lm.train.setup import build_run
from lm.train.steps import accumulate

T, V = 64, 264
LN2 = math.log(2.0)
PAIRS = [("sort 312", "123", "132"), ("sort 90", "09", "90"), ("sort 5521", "1255", "125"), ("sort 77", "77", "777")]


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


# ---- the formulas --------------------------------------------------------------------------------

LOGP, REF, COUNT = [[-3.0, -5.0]], [[-4.0, -4.0]], [[2.0, 4.0]]


def terms(**settings):
    s = dataclasses.replace(DpoSettings.from_config(base_config().dpo), **settings)
    loss, chosen, rejected = dpo_terms(s, jnp.array(LOGP), jnp.array(REF), jnp.array(COUNT))
    return float(loss[0]), float(chosen[0]), float(rejected[0])


def test_sigmoid_dpo_and_its_rewards():
    # z = (-3 + 4) - (-5 + 4) = 2; beta z = 1
    loss, chosen, rejected = terms(loss="sigmoid", beta=0.5)
    assert loss == pytest.approx(-log_sigmoid(1.0), rel=1e-6)
    assert (chosen, rejected) == pytest.approx((0.5, -0.5))


def test_conservative_dpo_label_smoothing():
    loss, _, _ = terms(loss="sigmoid", beta=0.5, label_smoothing=0.2)
    assert loss == pytest.approx(-0.8 * log_sigmoid(1.0) - 0.2 * log_sigmoid(-1.0), rel=1e-6)


def test_ipo_on_per_token_log_ratios():
    # chosen: +1 over 2 tokens, rejected: -1 over 4 tokens -> 0.5 + 0.25 = 0.75; target 1/(2 beta) = 1
    loss, _, _ = terms(loss="ipo", beta=0.5)
    assert loss == pytest.approx((0.75 - 1.0) ** 2, rel=1e-6)


def test_simpo_is_length_normalised_with_a_margin_and_no_reference():
    loss, chosen, rejected = terms(loss="simpo", beta=0.5, simpo_gamma=0.3)
    assert (chosen, rejected) == pytest.approx((0.5 * -3 / 2, 0.5 * -5 / 4))
    assert loss == pytest.approx(-log_sigmoid(-0.75 + 0.625 - 0.3), rel=1e-6)


def test_rpo_adds_the_chosen_per_token_nll():
    loss, _, _ = terms(loss="sigmoid", beta=0.5, rpo_alpha=2.0)
    assert loss == pytest.approx(-log_sigmoid(1.0) + 2.0 * 3.0 / 2.0, rel=1e-6)


def test_rpo_nll_per_response_or_over_the_batch_chosen_tokens():
    # chosen responses of 2 and 6 tokens (NLL 1.5 and 2 per token), then a padding pair that counts nowhere
    logp, count = jnp.array([[-3.0, -5.0], [-12.0, -2.0], [0.0, 0.0]]), jnp.array([[2.0, 4.0], [6.0, 1.0], [0.0, 0.0]])
    base = dataclasses.replace(DpoSettings.from_config(base_config().dpo), beta=0.5, rpo_alpha=2.0)
    dpo, _, _ = dpo_terms(dataclasses.replace(base, rpo_alpha=0.0), logp, logp - 1.0, count)
    per_response, _, _ = dpo_terms(base, logp, logp - 1.0, count)
    per_token, _, _ = dpo_terms(dataclasses.replace(base, rpo_nll="per_token"), logp, logp - 1.0, count)
    assert base.rpo_nll == "per_response"  # the default: the RPO paper's
    np.testing.assert_allclose(per_response[:2] - dpo[:2], [2.0 * 3 / 2, 2.0 * 12 / 6], rtol=1e-6)
    np.testing.assert_allclose(per_token[:2] - dpo[:2], [2.0 * 15 / 8] * 2, rtol=1e-6)  # TRL: (3 + 12) / (2 + 6)
    # what the step adds (the mean over the real pairs): 2 x 1.75 per response, 2 x 1.875 per token
    assert float(jnp.mean(per_response[:2] - dpo[:2])) == pytest.approx(3.5, rel=1e-6)
    assert float(jnp.mean(per_token[:2] - dpo[:2])) == pytest.approx(3.75, rel=1e-6)


def test_orpo_from_the_papers_equations_and_trls_form():
    # mean log-probs per token: chosen -3/2, rejected -5/4; odds = P / (1 - P), P = exp(mean)
    odds = [math.exp(m) / (1.0 - math.exp(m)) for m in (-1.5, -1.25)]
    ratio = math.log(odds[0] / odds[1])
    loss, chosen, rejected = terms(loss="orpo", beta=0.25)
    nll = 3.0 / 2.0  # the chosen NLL per chosen token
    assert loss == pytest.approx(nll - 0.25 * log_sigmoid(ratio), rel=1e-6)
    assert (chosen, rejected) == pytest.approx((0.25 * -1.5, 0.25 * -1.25))
    # TRL's spelling of the same log odds: (c - r) - (log1p(-exp(c)) - log1p(-exp(r)))
    c, r = -1.5, -1.25
    trl = (c - r) - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r)))
    logp, count = jnp.array(LOGP), jnp.array(COUNT)
    assert float(log_odds(logp, count)[0]) == pytest.approx(trl, rel=1e-6)
    assert float(orpo_metrics(logp, count)["log_odds_ratio"][0]) == pytest.approx(log_sigmoid(trl), rel=1e-6)


def test_orpo_keeps_a_response_of_probability_one_finite():
    logp, count = jnp.array([[0.0, -2.0], [0.0, 0.0]]), jnp.array([[3.0, 2.0], [0.0, 0.0]])  # a padding pair too
    s = dataclasses.replace(DpoSettings.from_config(base_config().dpo), loss="orpo")
    loss, _, _ = dpo_terms(s, logp, logp, count)
    grads = jax.grad(lambda x: jnp.sum(dpo_terms(s, x, x, count)[0]))(logp)
    assert np.all(np.isfinite(np.asarray(loss))) and np.all(np.isfinite(np.asarray(grads)))


def test_beta_defaults_to_the_loss_types_own():
    d = base_config().dpo
    assert d.beta == 0.0  # the loss's default, held once in LOSS_BETA
    assert {loss: DpoSettings.from_config(d.to_dict() | {"loss": loss}).loss_beta for loss in LOSS_BETA} == LOSS_BETA
    assert (LOSS_BETA["sigmoid"], LOSS_BETA["ipo"], LOSS_BETA["simpo"], d.simpo_gamma) == (0.1, 0.1, 2.0, 1.0)
    loss, chosen, rejected = terms(loss="simpo")  # SimPO's authors': beta 2, gamma / beta 0.5
    assert (chosen, rejected) == pytest.approx((2.0 * -3 / 2, 2.0 * -5 / 4))
    assert loss == pytest.approx(-log_sigmoid(-3.0 + 2.5 - 1.0), rel=1e-6)
    loss, chosen, _ = terms(loss="sigmoid")  # DPO keeps TRL's 0.1: z = 2
    assert (loss, chosen) == pytest.approx((-log_sigmoid(0.2), 0.1))
    assert terms(loss="simpo", beta=0.5)[1] == pytest.approx(0.5 * -3 / 2)  # a set beta wins
    assert load_config(None, ["dpo.loss=simpo"]).dpo.beta == 0.0
    with pytest.raises(UserError, match=r"^config key 'dpo.beta' = -1.0: expected > 0, or 0 for the loss's default"):
        load_config(None, ["dpo.beta=-1"])
    with pytest.raises(UserError, match=r"^config key 'dpo.rpo_nll'"):
        load_config(None, ["dpo.rpo_nll=mean"])


def test_bradley_terry_with_margin_and_centring():
    loss = reward_terms(jnp.array([1.0]), jnp.array([-0.5]), jnp.array([0.5]), 0.1)
    assert float(loss[0]) == pytest.approx(-log_sigmoid(1.0) + 0.1 * 0.25, rel=1e-6)


def test_sequence_logprobs_sum_only_masked_in_targets():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
    mask = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 0, 1]], np.float32)
    targets[0, 0] = 99  # out of range where the mask is 0: must not poison the sum
    logp, count = sequence_logprobs(jnp.array(logits), jnp.array(targets), jnp.array(mask))
    for b in range(2):
        expected = 0.0
        for t in range(5):
            if mask[b, t]:
                row = logits[b, t].astype(np.float64)
                expected += row[targets[b, t]] - math.log(np.exp(row).sum())
        assert float(logp[b]) == pytest.approx(expected, rel=1e-5)
        assert float(count[b]) == mask[b].sum()


def test_last_real_position():
    seg = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_real(seg).tolist() == [2, 4, 0]


# ---- real steps ------------------------------------------------------------------------------------


def config(pairs=4, micro=1, lora=0, **dpo):
    c = base_config()
    c.model.update(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T, lora_rank=lora
    )
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)
    c.train.update(batch_size=pairs, micro_batches=micro, steps=10)
    c.data.seq_len = T
    c.dpo.update(dpo)
    return c


def pair_batch(n_pad=0):
    """The PAIRS rendered with the byte tokenizer as [B, 2, T] rows (+ n_pad all-zero pairs)."""
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    b = len(PAIRS) + n_pad
    batch = {k: np.zeros((b, 2, T), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((b, 2, T), np.float32)
    batch["margin"] = np.zeros((b,), np.float32)
    for i, (prompt, *answers) in enumerate(PAIRS):
        for side, answer in enumerate(answers):
            ids, w = template.render([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
            n = len(ids) - 1
            batch["inputs"][i, side, :n], batch["targets"][i, side, :n] = ids[:-1], ids[1:]
            batch["loss_mask"][i, side, :n] = w[1:]
            batch["segment_ids"][i, side, :n], batch["positions"][i, side, :n] = 1, np.arange(n)
    return batch


@pytest.fixture(scope="module")
def base():
    """Params of a 'trained' model to start from (a fresh init with another seed)."""
    return jax.device_get(build_run(config()).init_state(seed=11).params)


def dpo_step(c, batch, base, devices=None, extra=None):
    run = build_dpo_run(c, devices=devices or jax.devices()[:1])
    state, frozen = run.init(seed=3, base=base)
    signature = run.signature(len(batch["inputs"]), pairs=True, extra=PAIR_EXTRA | (extra or {}))
    step = run.bind(run.train_step(signature), frozen)
    state, metrics = step(state, run.placer(signature).from_global(batch))
    return jax.device_get(state.params), jax.device_get(metrics), run


def test_ln2_at_step_zero_live_and_precomputed_reference_give_the_same_update_padding_counts_nowhere(base):
    batch = pair_batch()
    live, m_live, _ = dpo_step(config(), batch, base)
    # step 0: policy == reference, so the loss is ln 2 and the implicit rewards are all 0
    assert float(m_live["loss"]) == pytest.approx(LN2, abs=1e-6)
    # 0 up to rounding: the policy and the reference are separate compiled passes over the same
    # params, so each reward is beta * (a difference of two sums of magnitude |logps|)
    scale = (
        1e-6
        * DpoSettings.from_config(config().dpo).loss_beta
        * (abs(float(m_live["logps/chosen"])) + abs(float(m_live["logps/rejected"])))
    )
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(float(m_live[k])) <= scale, (k, float(m_live[k]), scale)
    assert float(m_live["pairs"]) == len(PAIRS) and float(m_live["logps/chosen"]) < 0
    run = build_dpo_run(config(reference="precomputed"), devices=jax.devices()[:1])
    ref = reference_logps(run, base, _Rows(batch), 2)
    padded = pair_batch(n_pad=4)
    padded["ref_logps"] = np.concatenate([ref, np.zeros((4, 2), np.float32)])
    pre, m_pre, _ = dpo_step(
        config(pairs=8, reference="precomputed"), padded, base, extra={"ref_logps": ((2,), np.float32)}
    )
    assert float(m_pre["pairs"]) == len(PAIRS)
    for k in ("loss", "rewards/chosen", "logps/rejected", "grad_norm"):
        assert float(m_pre[k]) == pytest.approx(float(m_live[k]), rel=1e-5, abs=1e-6), k
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), live, pre)


class _Rows:
    """A [B, 2, T] batch as ready rows (what lm.data.preference yields)."""

    def __init__(self, batch):
        self.batch, self.seq_len = batch, T

    def __len__(self):
        return len(self.batch["inputs"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def test_an_orpo_step_holds_no_reference_and_its_loss_is_the_nll_plus_the_odds_term_of_the_model(base):
    batch = pair_batch()
    run = build_dpo_run(config(loss="orpo"), devices=jax.devices()[:1])
    assert "reference" not in run.frozen
    _, m, _ = dpo_step(config(loss="orpo"), batch, base)
    logits = run.model.apply(
        {"params": base}, *(batch[k].reshape(-1, T) for k in ("inputs", "segment_ids", "positions"))
    )
    logp, count = sequence_logprobs(logits, batch["targets"].reshape(-1, T), batch["loss_mask"].reshape(-1, T))
    logp, count = np.asarray(logp, np.float64).reshape(-1, 2), np.asarray(count, np.float64).reshape(-1, 2)
    mean = logp / count
    odds = (mean[:, 0] - mean[:, 1]) - (np.log1p(-np.exp(mean[:, 0])) - np.log1p(-np.exp(mean[:, 1])))
    nll = -logp[:, 0].sum() / count[:, 0].sum()
    beta = LOSS_BETA["orpo"]
    expected = nll - beta * np.mean([log_sigmoid(x) for x in odds])
    assert float(m["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(m["nll_loss"]) == pytest.approx(nll, rel=1e-5)
    assert float(m["log_odds_chosen"]) == pytest.approx(odds.mean(), rel=1e-4, abs=1e-6)


def test_update_does_not_depend_on_the_micro_batch_split_simpo_holding_no_reference(base):
    one, m1, _ = dpo_step(config(loss="simpo"), pair_batch(), base)
    two, m2, _ = dpo_step(config(micro=2, loss="simpo"), pair_batch(), base)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), one, two)


class TableModel:
    """A 'model' whose logits at a position are the row of a [V, V] table for its input token."""

    def apply(self, variables, inputs, segment_ids, positions):
        return variables["params"]["table"][inputs]


@pytest.mark.parametrize("mode", ["per_response", "per_token"])
def test_rpo_nll_under_micro_batches_matches_numpy(mode):
    """The update's loss through the accumulation routine: DPO's pair mean plus alpha times the
    chosen NLL, per response (any split), or over the chosen tokens of each micro-batch (pairs
    k, k + n, ...; the pair-weighted mean of their token means); padding pairs count nowhere."""
    rng, v, t, beta, alpha = np.random.default_rng(0), 6, 8, 0.5, 0.7
    table = rng.normal(size=(v, v)).astype(np.float32)
    b = 6  # four real pairs, then two padding pairs (one in each micro-batch of two)
    batch = {
        "inputs": rng.integers(0, v, (b, 2, t)).astype(np.int32),
        "targets": rng.integers(0, v, (b, 2, t)).astype(np.int32),
        "segment_ids": np.ones((b, 2, t), np.int32),
        "positions": np.tile(np.arange(t, dtype=np.int32), (b, 2, 1)),
        "loss_mask": np.zeros((b, 2, t), np.float32),
        "ref_logps": rng.normal(-8, 1, (b, 2)).astype(np.float32),
    }
    for i, (c, r) in enumerate([(1, 3), (5, 2), (2, 2), (7, 4)]):
        batch["loss_mask"][i, 0, t - c :], batch["loss_mask"][i, 1, t - r :] = 1.0, 1.0
    x = table[batch["inputs"]].astype(np.float64)
    tok = np.take_along_axis(x, batch["targets"][..., None], -1)[..., 0] - np.log(np.exp(x).sum(-1))
    logp, n = (tok * batch["loss_mask"]).sum(-1)[:4], batch["loss_mask"].sum(-1)[:4]
    z = beta * ((logp[:, 0] - batch["ref_logps"][:4, 0]) - (logp[:, 1] - batch["ref_logps"][:4, 1]))
    dpo = np.log1p(np.exp(-z)).mean()
    nll = -logp[:, 0]
    s = dataclasses.replace(DpoSettings.from_config(base_config().dpo), beta=beta, rpo_alpha=alpha, rpo_nll=mode)
    loss_fn = dpo_loss(TableModel(), s, reference="precomputed")
    for micro in (1, 2):
        if mode == "per_response":
            want = dpo + alpha * np.mean(nll / n[:, 0])
        elif micro == 1:
            want = dpo + alpha * nll.sum() / n[:, 0].sum()
        else:  # micro-batch k: real pairs k and k + 2
            want = dpo + alpha * np.mean([nll[k::2].sum() / n[k::2, 0].sum() for k in range(2)])
        _, stats = jax.jit(
            lambda p, bt, m=micro: accumulate(lambda q, y, r: loss_fn(q, y, {}, r), p, bt, jax.random.PRNGKey(0), m)
        )({"table": table}, batch)
        assert float(stats["count"]) == 4
        assert float(stats["loss_sum"] / stats["count"]) == pytest.approx(want, rel=1e-5), micro
    if mode == "per_token":  # the split matters here, as under TRL's gradient accumulation
        assert abs(nll.sum() / n[:, 0].sum() - np.mean([nll[k::2].sum() / n[k::2, 0].sum() for k in range(2)])) > 0.01


@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_dpo_on_a_2x2x2_mesh_equals_one_device(base, loss):
    c8 = config(pairs=8, loss=loss)
    c8.mesh.update(data=2, fsdp=2, tensor=2)
    batch = pair_batch(n_pad=0)
    batch = {k: np.concatenate([v, v]) for k, v in batch.items()}
    one, m1, _ = dpo_step(config(pairs=8, loss=loss), batch, base)
    eight, m8, _ = dpo_step(c8, batch, base, devices=jax.devices()[:8])
    assert float(m8["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one, eight)


def test_lora_reference_is_the_base_with_adapters_off(base):
    _, m, run = dpo_step(config(lora=4), pair_batch(), base)
    assert run.frozen["reference"].shares_base and run.frozen["reference"].built.spec.lora.rank == 0  # no copy
    assert float(m["loss"]) == pytest.approx(LN2, abs=1e-6)  # B = 0: policy == base at step 0


def test_reward_model_starts_neutral_and_scores_the_last_real_token(base):
    run = build_reward_run(config(), devices=jax.devices()[:1])
    state, frozen = run.init(seed=3, base=base)
    signature = run.signature(len(PAIRS), pairs=True, extra=PAIR_EXTRA)
    step = run.bind(run.train_step(signature), frozen)
    state, m = step(state, run.placer(signature).from_global(pair_batch()))
    assert float(m["loss"]) == pytest.approx(LN2, abs=1e-6) and float(m["accuracy"]) == 0.0
    params = jax.device_get(state.params)
    rows = {k: jnp.asarray(v[:, 0]) for k, v in pair_batch().items() if k != "margin"}
    scores = run.model.apply(
        {"params": params}, rows["inputs"], rows["segment_ids"], rows["positions"], output="scalar"
    )
    last = np.asarray(rows["segment_ids"]).sum(-1) - 1
    np.testing.assert_allclose(
        sequence_scores(run.model, params, rows), np.asarray(scores)[np.arange(len(PAIRS)), last], rtol=1e-6
    )
    assert np.ptp(np.asarray(scores)) > 0  # one step moved the head off zero
