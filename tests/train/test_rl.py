"""RL from rewards: group advantages, GAE, the clip, k3 and value terms against hand-computed
values; each loss_type's normalisation and GSPO's sequence ratio against numpy, under micro-batch
splits; log-probs (policy, old, reference) at the sampling temperature; through a tiny model:
the loss is the plain policy gradient when ratios are 1 and the KL 0, a group of equal rewards
gives no gradient, the first update at temperature 0.7 has ratio 1, and a whole GRPO step
(rollouts, rewards, reference scoring, two minibatch updates) on a (2,2,2) mesh equals one
device; a PPO step with LoRA trains its adapters and value head; rewards combine functions, a
reward model and a truncation penalty by weight."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config
from lm.data.chat import ChatTemplate
from lm.data.prompts import PromptSet
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.infer.sampling import SamplingParams
from lm.model.apply import logits_of, token_logprobs
from lm.train.rewards import RewardFn, Rewards, parse_rewards
from lm.train.rl import build_rl_run
from lm.train.rl_losses import (
    RlSettings,
    gae,
    group_advantages,
    importance_ratio,
    k3,
    policy_terms,
    rl_loss,
    value_terms,
    whiten,
)
from lm.train.rl_step import RlStep
from lm.train.rollout import Sampler, Scorer
from lm.train.steps import accumulate

T, V = 64, 264  # the byte template's prompts take ~40 tokens


def rl_settings(**changes) -> RlSettings:
    """The rl section's defaults with `changes`."""
    return dataclasses.replace(RlSettings.from_config(base_config().rl), **changes)


# ---- the formulas --------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(4 * 0.25 / 3)  # the sample std of (1, 0, 0, 1)
    adv = group_advantages(rewards, 4, scale=True, eps=1e-4)
    np.testing.assert_allclose(adv[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4), rtol=1e-6)
    np.testing.assert_array_equal(adv[4:], 0.0)  # equal rewards: no advantage
    np.testing.assert_allclose(group_advantages(rewards, 4, scale=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_gae_by_hand():
    # one prompt token, then three response tokens; reward 1 on the last; gamma 1, lambda 0.5
    rewards = np.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = np.array([[9.0, 0.5, 0.6, 0.7, 9.0]])
    mask = np.array([[0.0, 1.0, 1.0, 1.0, 0.0]])
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # a3 = 1 - 0.7 = 0.3; a2 = (0.7 - 0.6) + 0.5 * 0.3 = 0.25; a1 = (0.6 - 0.5) + 0.5 * 0.25 = 0.225
    np.testing.assert_allclose(adv[0], [0.0, 0.225, 0.25, 0.3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(returns[0], [0.0, 0.725, 0.85, 1.0, 0.0], rtol=1e-6)
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # a3 = 0.3; a2 = 0.5 * 0.7 - 0.6 + 0.5 * 0.3 = -0.1; a1 = 0.5 * 0.6 - 0.5 + 0.5 * -0.1 = -0.25
    np.testing.assert_allclose(adv[0, 1:4], [-0.25, -0.1, 0.3], rtol=1e-6)


def test_whiten_over_the_mask():
    x = np.array([[5.0, 1.0, 3.0, 7.0]])
    out = whiten(x, np.array([[0.0, 1.0, 1.0, 1.0]]))
    np.testing.assert_allclose(out[0, 1:], (np.array([1.0, 3.0, 7.0]) - 11 / 3) / np.std([1.0, 3.0, 7.0]), rtol=1e-5)
    assert out[0, 0] == 0.0


def test_clip_k3_and_value_terms_by_hand():
    logp = jnp.log(jnp.array([1.5, 0.5, 1.5, 1.0]))
    old = jnp.zeros(4)
    adv = jnp.array([1.0, 1.0, -1.0, 2.0])
    ratio = importance_ratio(logp, old, jnp.ones(4))
    loss, clipped = policy_terms(ratio, adv, 0.2, 0.3)
    # ratio 1.5, A 1: min(1.5, 1.3) -> clipped; 0.5: min(0.5, 0.8) -> not; 1.5, A -1: min(-1.5, -1.3) -> not
    np.testing.assert_allclose(loss, [-1.3, -0.5, 1.5, -2.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(ratio, [1.5, 0.5, 1.5, 1.0], rtol=1e-6)
    d = 0.3
    # exp(d) - d - 1 cancels: float32 rounding of exp(d) ~ 1.35 is absolute, a few 1e-7
    np.testing.assert_allclose(
        k3(jnp.array([0.0, -1.0]), jnp.array([0.0, -1.0 + d])), [0.0, math.exp(d) - d - 1], rtol=1e-6, atol=1e-6
    )
    vloss, vclip = value_terms(jnp.array([1.0, 0.5]), jnp.array([0.0, 0.4]), jnp.array([0.0, 1.0]), 0.2)
    # row 0: (1 - 0)^2 = 1 vs (0.2 - 0)^2 = 0.04 -> 0.5; row 1: 0.25 vs (0.5 - 1)^2 = 0.25 -> 0.125
    np.testing.assert_allclose(vloss, [0.5, 0.125], rtol=1e-6)
    np.testing.assert_array_equal(vclip, [0.0, 0.0])


# ---- the loss types, GSPO and the temperature against numpy (float64) -----------------------------


class TableModel:
    """A 'model' whose logits at a position are the row of a [V, V] table for its input token:
    its log-probs and their gradients are computable by hand."""

    def apply(self, variables, inputs, segment_ids, positions):
        return variables["params"]["table"][inputs]


HB, HT, HV, HL = 4, 7, 5, 6  # rows, positions, vocab, max_new_tokens


def hand_batch(temperature=1.0, noise=0.3, seed=0):
    """(params, batch) with responses of 1, 2, 4 and 6 tokens at different offsets; old and
    reference log-probs near the policy's so that some ratios clip."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(HV, HV)).astype(np.float32)
    inputs = rng.integers(0, HV, (HB, HT)).astype(np.int32)
    targets = rng.integers(0, HV, (HB, HT)).astype(np.int32)
    mask = np.zeros((HB, HT), np.float32)
    for i, (start, n) in enumerate([(3, 1), (1, 2), (2, 4), (0, 6)]):
        mask[i, start : start + n] = 1.0
    logp = np_logp(table, inputs, targets, temperature)
    batch = {
        "inputs": inputs,
        "targets": targets,
        "loss_mask": mask,
        "segment_ids": np.ones((HB, HT), np.int32),
        "positions": np.tile(np.arange(HT, dtype=np.int32), (HB, 1)),
        "old_logp": ((logp + noise * (rng.normal(size=logp.shape) + [[-1], [1], [0], [0]])) * mask).astype(np.float32),
        "ref_logp": ((logp + 0.2 * rng.normal(size=logp.shape)) * mask).astype(np.float32),
        "advantages": (np.array([1.0, -0.5, 2.0, -1.5])[:, None] * mask).astype(np.float32),
    }
    return {"table": table}, batch


def np_logp(table, inputs, targets, temperature):
    x = table[inputs].astype(np.float64) / temperature
    x = x - x.max(axis=-1, keepdims=True)
    return np.take_along_axis(x, targets[..., None], axis=-1)[..., 0] - np.log(np.exp(x).sum(axis=-1))


def hand_loss(xp, logp, b, s: RlSettings, n_micro: int):
    """TRL's per-token loss and loss_type normalisations, written out (numpy float64, or jnp for grads)."""
    m = b["loss_mask"]
    log_ratio = xp.where(m > 0, logp - b["old_logp"], 0.0)
    if s.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdims=True) / m.sum(-1, keepdims=True) + 0.0 * log_ratio
    r, a = xp.exp(log_ratio), b["advantages"]
    pg = -xp.minimum(r * a, xp.clip(r, 1 - s.eps_low, 1 + s.eps_high) * a)
    d = b["ref_logp"] - logp
    per_token = (pg + s.beta * (xp.exp(d) - d - 1)) * m
    if s.loss_type == "dapo":
        return per_token.sum() / m.sum()
    if s.loss_type == "grpo":
        return (per_token.sum(-1) / m.sum(-1)).mean()
    if s.loss_type == "dr_grpo":
        return per_token.sum() / (len(m) * s.max_new_tokens)
    # bnpo: micro-batch k holds rows k, k + n, ... (lm.train.steps.split_micro)
    return sum(per_token[k::n_micro].sum() / m[k::n_micro].sum() for k in range(n_micro)) / n_micro


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_loss_types_and_sequence_ratio_match_numpy_whatever_the_micro_batch_split(loss_type, level):
    params, batch = hand_batch()
    s = rl_settings(loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_new_tokens=HL)
    loss_fn = rl_loss(TableModel(), s)
    micro_loss = lambda p, b, r: loss_fn(p, b, {}, r)  # noqa: E731  (the step's view: frozen bound)
    logp = np_logp(params["table"], batch["inputs"], batch["targets"], 1.0)
    tokens = batch["loss_mask"].sum()
    for n_micro in (1, 2):
        grads, stats = jax.jit(lambda p, b, n=n_micro: accumulate(micro_loss, p, b, jax.random.PRNGKey(0), n))(
            params, batch
        )
        expected = hand_loss(np, logp, batch, s, n_micro)
        assert float(stats["loss_sum"] / stats["count"]) == pytest.approx(expected, rel=1e-5), n_micro
        assert float(stats["tokens_total"]) == tokens  # the statistics stay per response token
        # the update's gradient: summed over micro-batches, divided once by the summed count
        want = jax.grad(
            lambda p, n=n_micro: hand_loss(
                jnp,
                jax.nn.log_softmax(p["table"][batch["inputs"]])[
                    np.arange(HB)[:, None], np.arange(HT), batch["targets"]
                ],
                batch,
                s,
                n,
            )
        )(params)
        np.testing.assert_allclose(grads["table"] / stats["count"], want["table"], rtol=1e-4, atol=1e-7)
    clipped = float(stats["clip_fraction_total"]) / tokens
    assert 0 < clipped < 1  # the clip is exercised
    if level == "sequence":  # one ratio per response, on each of its tokens
        ratio = np.exp(
            [
                (batch["loss_mask"][i] * (logp[i] - batch["old_logp"][i])).sum() / batch["loss_mask"][i].sum()
                for i in range(HB)
            ]
        )
        assert float(stats["ratio_total"]) == pytest.approx(float((ratio * batch["loss_mask"].sum(-1)).sum()), rel=1e-5)


def test_log_probs_are_taken_at_the_sampling_temperature():
    """At temperature 0.7 with the old log-probs those of the sampling distribution (the same
    params): ratio 1, no clip, and the gradient is the plain policy gradient of log softmax(x / 0.7)."""
    t = 0.7
    params, batch = hand_batch(temperature=t, noise=0.0)
    logp = np_logp(params["table"], batch["inputs"], batch["targets"], t)
    batch |= {"old_logp": logp.astype(np.float32), "ref_logp": logp.astype(np.float32)}
    (objective, stats), grads = jax.jit(
        jax.value_and_grad(rl_loss(TableModel(), rl_settings(temperature=t)), has_aux=True)
    )(params, batch, {}, None)
    tokens, m = float(stats["tokens_total"]), batch["loss_mask"]
    assert float(stats["ratio_total"]) / tokens == pytest.approx(1.0, abs=1e-6)
    assert float(stats["clip_fraction_total"]) == 0.0 and abs(float(stats["kl_total"])) < 1e-6
    # d(-A log softmax(x / t)[y]) / dx = -(A / t) (onehot(y) - softmax(x / t)), into the input token's row
    x = params["table"][batch["inputs"]].astype(np.float64) / t
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d_logits = -(batch["advantages"] * m)[..., None] / t * (np.eye(HV)[batch["targets"]] - p)
    want = np.zeros((HV, HV))
    np.add.at(want, batch["inputs"], d_logits)
    np.testing.assert_allclose(np.asarray(grads["table"], np.float64), want, rtol=1e-4, atol=1e-6)
    assert float(objective) == pytest.approx(-float(batch["advantages"].sum()), rel=1e-6)


# ---- a tiny model ----------------------------------------------------------------------------------


def config(algo="grpo", beta=0.1, lora=0, **rl):
    c = base_config()
    c.model.update(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=T, lora_rank=lora
    )
    c.optim.update(lr=1e-2, warmup_steps=0, weight_decay=0.0, eps=1.0)  # eps: no amplified round-off
    c.train.update(steps=10)
    c.data.seq_len = T
    c.rl.update(algo=algo, beta=beta, prompts_per_step=4, group_size=4, max_new_tokens=8, **rl)
    return c


def rows(seed=0, b=4):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (b, T + 1)).astype(np.int32)
    mask = np.zeros((b, T), np.float32)
    for i in range(b):
        mask[i, 5 + i : 15 + 2 * i] = 1.0  # responses of different lengths after a prompt
    return {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "loss_mask": mask,
        "segment_ids": np.ones((b, T), np.int32),
        "positions": np.tile(np.arange(T, dtype=np.int32), (b, 1)),
    }


@pytest.fixture(scope="module")
def tiny():
    run = build_rl_run(config(beta=0.0), devices=jax.devices()[:1])  # no reference: init needs no base
    return run, jax.device_get(run.init_state(seed=1).params)


def test_loss_is_the_plain_policy_gradient_when_ratios_are_one_and_kl_zero(tiny):
    run, params = tiny
    batch = rows()
    logp = np.asarray(jax.jit(lambda p, b: token_logprobs(run.model, p, b))(params, batch))
    adv = np.array([1.0, -0.5, 2.0, 0.0], np.float32)[:, None] * batch["loss_mask"]
    batch |= {"old_logp": logp, "ref_logp": logp, "advantages": adv}
    loss_fn = rl_loss(run.model, rl_settings(beta=0.1))
    (objective, stats), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, {}, None)
    count = batch["loss_mask"].sum()

    def plain_pg(p):
        lp = token_logprobs(run.model, p, batch)
        return -jnp.sum(adv * lp * batch["loss_mask"])

    expected = jax.jit(jax.grad(plain_pg))(params)
    assert float(stats["count"]) == count == float(stats["tokens_total"])  # dapo: the response tokens
    assert float(objective) == pytest.approx(-float(np.sum(adv)), rel=1e-5)  # ratio 1: -sum A
    assert float(stats["kl_total"]) == pytest.approx(0.0, abs=1e-6)
    assert float(stats["ratio_total"]) / count == pytest.approx(1.0, abs=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, expected)


def test_a_group_of_equal_rewards_gives_no_gradient(tiny):
    run, params = tiny
    batch = rows()
    logp = np.asarray(jax.jit(lambda p, b: token_logprobs(run.model, p, b))(params, batch))
    adv = group_advantages(np.array([0.7, 0.7, 0.7, 0.7]), 4)[:, None] * batch["loss_mask"]
    batch |= {"old_logp": logp, "ref_logp": logp, "advantages": adv}
    grad = jax.jit(jax.grad(lambda p, b: rl_loss(run.model, rl_settings(beta=0.1))(p, b, {}, None)[0]))
    largest = lambda g: max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))  # noqa: E731
    # the same rows with rewards that differ set the scale: equal rewards give 0 up to rounding
    spread = group_advantages(np.array([0.1, 0.4, 0.7, 1.0]), 4)[:, None] * batch["loss_mask"]
    scale = largest(grad(params, batch | {"advantages": spread}))
    assert scale > 0
    assert largest(grad(params, batch)) <= 1e-5 * scale


def test_the_scoring_pass_takes_old_and_reference_log_probs_at_the_temperature(tiny):
    _, policy = tiny
    run = build_rl_run(config(beta=0.1, temperature=0.7), devices=jax.devices()[:1])
    reference = jax.device_get(build_rl_run(config(beta=0.0), devices=jax.devices()[:1]).init_state(seed=2).params)
    _, frozen = run.init(seed=5, base=reference)
    batch = rows()
    scored = Scorer(run, with_values=False)(policy, frozen, batch, run.placer(run.signature(len(batch["inputs"]))))

    def expected(module, params):
        x = np.asarray(jax.jit(lambda p: logits_of(module, p, batch))(params), np.float64) / 0.7
        x -= x.max(-1, keepdims=True)
        logp = np.take_along_axis(x, batch["targets"][..., None], -1)[..., 0] - np.log(np.exp(x).sum(-1))
        return logp * batch["loss_mask"]

    np.testing.assert_allclose(scored["old_logp"], expected(run.model, policy), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        scored["ref_logp"], expected(run.frozen["reference"].built.module, reference), rtol=1e-5, atol=1e-5
    )


def digit_share(prompts, completions, **columns):
    """A reward with spread on an untrained model: the share of digits in the response."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def prompt_set():
    tok = ByteTokenizer()
    template = ChatTemplate.for_tokenizer(tok)
    texts = ["sort 312", "sort 90", "sort 5521", "sort 77"]
    messages = [[{"role": "user", "content": t}] for t in texts]
    ids = [template.prompt(m) for m in messages]
    padded = np.zeros((4, max(map(len, ids))), np.int32)
    for i, x in enumerate(ids):
        padded[i, : len(x)] = x
    return PromptSet(
        "test", padded, np.array([len(x) for x in ids], np.int32), texts, messages, [{} for _ in texts], {}
    ), template


def rl_step(c, devices):
    run = build_rl_run(c, devices=devices)
    base = build_rl_run(config(beta=0.0), devices=devices[:1]).init_state(seed=1).params
    state, frozen = run.init(seed=5, base=jax.device_get(base))
    prompts, template = prompt_set()
    settings = RlSettings.from_config(c.rl)
    sampling = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=c.rl.temperature, top_p=c.rl.top_p)
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    scorer = Scorer(run, settings.algo == "ppo")
    rewards = Rewards([RewardFn("digits", digit_share, 1.0)])
    step = RlStep(run, frozen, prompts, rewards, sampler, scorer, template, settings, c.rl)
    state, metrics = step(state, {"index": np.arange(4, dtype=np.int32)})
    return jax.device_get(state), metrics


def test_grpo_step_on_a_2x2x2_mesh_equals_one_device():
    c1 = config(minibatches=2)
    c8 = config(minibatches=2)
    c8.mesh.update(data=2, fsdp=2, tensor=2)
    one, m1 = rl_step(c1, jax.devices()[:1])
    eight, m8 = rl_step(c8, jax.devices()[:8])
    assert int(one.step) == 2  # two minibatch updates
    assert m1["reward_std"] > 0 and 0 <= m1["zero_std_groups"] < 1
    for k in ("reward", "response_length", "truncated"):
        assert m8[k] == pytest.approx(m1[k], rel=1e-6), k
    for k in ("loss", "kl", "clip_fraction", "entropy"):
        assert m8[k] == pytest.approx(m1[k], rel=1e-3, abs=1e-6), k
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one.params, eight.params)


@pytest.mark.slow
def test_first_update_at_temperature_0_7_has_ratio_one_and_no_kl():
    """Sampled at temperature 0.7 and top-p 0.9; the old, the policy's and the reference's log-probs
    are all at 0.7, from the same params: the first update's ratio is 1 and the KL 0."""
    _, m = rl_step(config(beta=0.1, temperature=0.7, top_p=0.9), jax.devices()[:1])
    assert m["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert m["clip_fraction"] == 0.0
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)


def test_ppo_with_lora_trains_adapters_and_value_head_with_the_kl_in_the_reward():
    state, m = rl_step(config("ppo", beta=0.05, lora=4, epochs=2), jax.devices()[:1])
    assert int(state.step) == 2  # two epochs over one minibatch
    assert {"value_loss", "value_clip_fraction", "explained_variance", "kl", "value_mean"} <= m.keys()
    # sampled by the init model, and the reference is the base with the adapters off: equal at step 0
    assert m["kl"] == pytest.approx(0.0, abs=1e-4)
    assert set(state.params) == {"blocks", "scalar_head"}  # adapters and the head train, nothing else
    assert float(np.abs(state.params["scalar_head"]["kernel"]).max()) > 0  # the zero head learned


class _Scorer:
    def score(self, conversations):
        return np.array([len(c[-1]["content"]) for c in conversations], np.float32)


def test_rewards_weigh_functions_and_a_reward_model_and_penalise_truncation(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def ones(prompts, completions, answer, **kw):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    fns = parse_rewards(f"lm.data.synthetic:sort_reward=0.5, {tmp_path / 'mine.py'}:ones")
    rewards = Rewards(fns, _Scorer(), scorer_weight=0.1, truncation_penalty=2.0)
    prompts = ["sort 312", [{"role": "user", "content": "sort 90"}]]
    messages = [[{"role": "user", "content": "sort 312"}], prompts[1]]
    total, parts = rewards(
        prompts, messages, ["123", "9"], np.array([False, True]), [{"answer": "123"}, {"answer": "09"}]
    )
    assert parts["sort_reward"].tolist() == [1.0, 0.0] and parts["ones"].tolist() == [1.0, 0.0]
    assert parts["reward_model"].tolist() == [3.0, 1.0]
    np.testing.assert_allclose(total, [0.5 + 1.0 + 0.3, 0.1 - 2.0], rtol=1e-6)
    bad = Rewards([RewardFn("short", lambda p, c, **k: [1.0], 1.0)])
    with pytest.raises(UserError, match="short"):
        bad(prompts, messages, ["1", "2"], np.zeros(2, bool), [{}, {}])
    for spec in ("no_such_module:fn", "lm.data.synthetic:no_such_fn", "missing.py:fn", "nocolon"):
        with pytest.raises(UserError, match="rl.rewards"):
            parse_rewards(spec)


def test_a_speculating_sampler_gives_the_plain_greedy_responses():
    """rl.speculate: prompt-lookup drafts while sampling; at temperature 0 the responses and
    their log-probs are the plain sampler's."""
    c = config(beta=0.0)
    run = build_rl_run(c, devices=jax.devices()[:1])
    state, frozen = run.init(seed=5)
    prompts, template = prompt_set()
    greedy = SamplingParams(max_new_tokens=c.rl.max_new_tokens, temperature=0)
    ids = [list(map(int, p[:n])) for p, n in zip(prompts.ids, prompts.lengths)]
    out = {}
    for k in (0, 3):
        sampler = Sampler(run, greedy, template.stop_ids, c.data.seq_len, speculate=k)
        out[k] = sampler(sampler.params(state.params, frozen), ids, jax.random.PRNGKey(0))
    assert [x.tolist() for x in out[3].ids] == [x.tolist() for x in out[0].ids]
    for a, b in zip(out[3].logprobs, out[0].logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
