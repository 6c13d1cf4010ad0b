"""Speculative decoding: greedy output equal to plain greedy decoding with a draft model and with
n-gram drafts (EOS, max_new_tokens and a full context included), the rejection sampler's
emitted tokens distributed as the target's, prompt-lookup drafts, `lm sample --draft`, and the
one-line errors."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.cli import main
from lm.errors import UserError
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.spec_verify import accept_drafts, ngram_drafts
from lm.infer.speculative import NGRAM, DraftModel, SpeculativeDecoder
from lm.model.transformer import Transformer
from tests.infer.test_sample_cli import export  # noqa: F401  (a fixture: a tiny random export)
from tests.model.test_transformer import model_spec, random_params

TARGET = model_spec(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=48, init_std=0.3
)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)
# a repetitive prompt (n-gram matches), a one-token prompt, and one that fills the context (32 + 16 = 48)
PROMPTS = [[5, 9, 13, 2], [7], [1, 2, 3, 4] * 4, list(range(3, 35))]


@functools.cache
def models():
    """The target, and a draft that agrees with it about half the time: the target's first layer
    alone (a smaller model with its vocabulary), the target's second layer damped so it often
    leaves the first layer's choice as it is."""
    target = Transformer(TARGET)
    params = random_params(target, seed=1)
    damp = lambda path, x: x.at[1].multiply(0.3) if path[-1].key in ("wo", "w_down") else x
    params = jax.tree_util.tree_map_with_path(damp, params)
    draft = Transformer(dataclasses.replace(TARGET, n_layers=1))
    draft_params = params | {"blocks": jax.tree.map(lambda x: x[:1], params["blocks"])}
    return target, params, DraftModel(draft, draft_params)


@functools.cache
def plain(sampling):
    target, params, _ = models()
    return Generator(target, params, sampling, eos_id=-1)(PROMPTS)


@pytest.mark.parametrize("kind", ["model", NGRAM])
def test_greedy_speculation_gives_plain_greedy_tokens(kind):
    target, params, draft = models()
    ref = plain(GREEDY)
    out = SpeculativeDecoder(target, params, GREEDY, draft=draft if kind == "model" else NGRAM, k=3, eos_id=-1)(PROMPTS)
    for want, got, want_logp, got_logp in zip(ref.ids, out.ids, ref.logprobs, out.logprobs):
        assert got.tolist() == want.tolist()
        np.testing.assert_allclose(got_logp, want_logp, atol=1e-4)
    assert out.finish == ref.finish == ["length"] * len(PROMPTS)
    # drafts were both kept and rejected, so both paths of the sampler produced these tokens
    assert 0 < out.accepted < out.proposed, (out.accepted, out.proposed)
    assert out.tokens_per_call > (1.5 if kind == "model" else 1.0)


def test_eos_and_max_new_tokens_end_speculation_where_plain_decoding_ends():
    target, params, draft = models()
    free = plain(GREEDY)
    eos = int(free.ids[2][5])  # the repetitive prompt's sixth new token ends it early
    # greedy decoding that stops at `eos` gives the free tokens up to its first occurrence
    ends = [np.flatnonzero(i == eos) for i in free.ids]
    want = [i[: e[0] + 1].tolist() if len(e) else i.tolist() for i, e in zip(free.ids, ends)]
    assert len(want[2]) <= 6
    for d in (draft, NGRAM):
        out = SpeculativeDecoder(target, params, GREEDY, draft=d, k=3, eos_id=eos)(PROMPTS)
        assert [i.tolist() for i in out.ids] == want
        assert out.finish == ["eos" if len(e) else "length" for e in ends]
    one = SamplingParams(max_new_tokens=1, temperature=0)
    out = SpeculativeDecoder(target, params, one, draft=NGRAM, k=3, eos_id=-1)(PROMPTS)  # k=3: compiled above
    assert [i.tolist() for i in out.ids] == [i[:1].tolist() for i in free.ids] and out.target_calls == len(PROMPTS)


def test_sampling_with_the_target_as_its_own_draft_keeps_its_drafts_and_is_seeded():
    target, params, _ = models()
    hot = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, top_p=0.95, seed=3)
    same = DraftModel(target, params)  # q = p up to rounding: a draft is kept with probability ~1
    a, b = (SpeculativeDecoder(target, params, hot, draft=same, k=3, eos_id=-1)(PROMPTS[:2]) for _ in range(2))
    assert a.acceptance_rate > 0.95 and a.tokens_per_call > 2.5
    assert [i.tolist() for i in a.ids] == [i.tolist() for i in b.ids] and all(len(i) == 16 for i in a.ids)
    greedy = plain(GREEDY)
    assert any(x.tolist() != y.tolist() for x, y in zip(a.ids, greedy.ids))  # it really sampled


# ---- the rejection sampler alone --------------------------------------------------------------

V, K, DRAWS = 6, 2, 20_000
P = jnp.asarray(
    [[0.05, 0.40, 0.05, 0.20, 0.25, 0.05], [0.30, 0.10, 0.10, 0.10, 0.10, 0.30], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]
)
Q_MODEL = jnp.asarray([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10], [0.05, 0.05, 0.30, 0.30, 0.25, 0.05]])
Q_POINT = jax.nn.one_hot(jnp.asarray([1, 5]), V)  # an n-gram draft: a point mass


def faithful(key, p, q):
    key_draft, key_accept = jax.random.split(key)
    drafts = jax.random.categorical(key_draft, jnp.log(q), axis=-1).astype(jnp.int32)
    n_acc, following = accept_drafts(key_accept, p, q, drafts, jnp.int32(K))
    return jnp.concatenate([drafts, following[None]]).at[n_acc].set(following), n_acc


def always_accepting(key, p, q):
    """What a broken sampler emits: the drafts as they are."""
    drafts = jax.random.categorical(jax.random.split(key)[0], jnp.log(q), axis=-1).astype(jnp.int32)
    return jnp.concatenate([drafts, drafts[:1]]), jnp.int32(K)


def chi_square(tokens: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic of the tokens' counts against p (V - 1 = 5 degrees of freedom)."""
    counts = np.bincount(tokens, minlength=len(p))
    expected = len(tokens) * p
    return float(np.sum((counts - expected) ** 2 / expected))


CRITICAL = 20.5  # chi-square with 5 degrees of freedom at p = 0.001


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
    assert chi_square(tokens[:, 0], p[0]) < CRITICAL  # the first token, kept draft or resampled
    second = tokens[n_acc >= 1, 1]  # after a kept first draft, the next token follows p[1]
    assert len(second) > 2_000 and chi_square(second, p[1]) < CRITICAL
    wrong, _ = emitted(always_accepting, q)  # the same check catches a sampler that keeps every draft
    assert chi_square(wrong[:, 0], p[0]) > 10 * CRITICAL


def test_no_valid_draft_samples_the_target_and_an_equal_draft_is_always_kept():
    keys = jax.random.split(jax.random.PRNGKey(1), DRAWS)
    drafts = jnp.asarray([2, 2], jnp.int32)
    n_acc, tokens = jax.vmap(lambda k: accept_drafts(k, P, Q_MODEL, drafts, jnp.int32(0)))(keys)
    assert not np.any(n_acc) and chi_square(np.asarray(tokens), np.asarray(P[0], np.float64)) < CRITICAL
    n_acc, _ = jax.vmap(lambda k: accept_drafts(k, P, P[:K], drafts, jnp.int32(K)))(keys)
    assert np.all(np.asarray(n_acc) == K)


# ---- prompt lookup ----------------------------------------------------------------------------


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


# ---- errors and the CLI -----------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_or_a_bad_k_is_one_line():
    target, params, _ = models()
    other = Transformer(dataclasses.replace(TARGET, vocab_size=80, n_layers=1))
    with pytest.raises(UserError, match="vocabulary of 80 tokens, the target's has 64"):
        SpeculativeDecoder(target, params, GREEDY, draft=DraftModel(other, {}), eos_id=-1)
    for k in (0, -2, 1.5):
        with pytest.raises(UserError, match=f"k={k!r}: expected an integer >= 1"):
            SpeculativeDecoder(target, params, GREEDY, draft=NGRAM, k=k, eos_id=-1)
    with pytest.raises(UserError, match="draft='bigram'"):
        SpeculativeDecoder(target, params, GREEDY, draft="bigram", eos_id=-1)


def test_lm_sample_streams_and_writes_the_greedy_tokens_with_a_draft(export, tmp_path, capsys):  # noqa: F811
    args = [
        "sample",
        "--params",
        str(export),
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
        "--draft",
        str(export),
        "--draft-k",
        "2",
    ]  # the export as its own draft: every draft is kept
    assert main([*args, "--prompt", "def f("]) == 0
    streamed = capsys.readouterr()
    assert "[length: 10 tokens; speculative: 6/6 drafts kept (100%), 2.50 tokens per target call]" in streamed.err
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(", "ab"]))
    assert main([*args, "--prompts", str(prompts), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert streamed.out == "def f(" + rows[0]["completion"] and all(len(r["tokens"]) == 10 for r in rows)
    assert rows[1]["tokens"] != rows[0]["tokens"]
    assert main([*args, "--prompt", "hi", "--chat"]) == 0  # the chat template's end ids and stop strings
    assert "speculative: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--draft-k", "2"], "--draft-k needs --draft"),
        (["--draft", "ngram", "--draft-k", "0"], "k=0: expected an integer >= 1"),
        (["--draft", "MISSING"], "MISSING"),
    ],
)
def test_bad_draft_flags_are_one_line(export, capsys, extra, words):  # noqa: F811
    assert main(["sample", "--params", str(export), "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm: error:") and words in err and "\n" not in err, err
