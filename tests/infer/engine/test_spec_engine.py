"""Speculation inside the engine (prompt lookup, every row at once): greedy tokens and log-probs
equal to plain decoding in any mix of rows, end ids and budgets where plain decoding ends them,
drafts really kept; sampled rows drawn from the target's filtered distribution (counted) and greedy
rows given the argmax, side by side in one batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.cli import main
from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.engine.spec_steps import row_probs
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.spec_verify import accept_drafts
from tests.infer.engine.test_draft_engine import GREEDY, PROMPTS, chi_square, models, plain
from tests.infer.test_sample_cli import export  # noqa: F401  (a fixture: a tiny random export)

MORE = PROMPTS + [[9, 9, 9, 9, 9], [3, 4, 3, 4, 3, 4, 3]]


def run(prompts, sampling, eos=(-1,), **config):
    target, params, _, _ = models()
    config = EngineConfig(slots=3, page_size=4, chunk=8, decode_block=4, idle_block=8, **config)
    engine = Engine(target, max_len=48, config=config)
    reqs = engine.run(params, [Request(list(p), sampling, eos=eos) for p in prompts])
    return engine, reqs


@pytest.mark.parametrize("every", [1, 3])
def test_greedy_speculation_in_the_engine_equals_plain_decoding(every):
    """Seven prompts through three slots (they queue), a prompt that fills the context, rows that
    find n-gram matches and rows that do not: the tokens and log-probs of plain decoding."""
    want = plain(GREEDY)
    target, params, _, _ = models()
    more = Generator(target, params, GREEDY, eos_id=-1)(MORE[len(PROMPTS) :])
    engine, reqs = run(MORE, GREEDY, speculate=4, check_every=every)
    for r, ids, logps in zip(reqs, list(want.ids) + list(more.ids), list(want.logprobs) + list(more.logprobs)):
        assert r.ids == ids.tolist() and r.finish == "length"
        np.testing.assert_allclose(r.logps, logps, rtol=1e-4, atol=1e-4)
    proposed, accepted = engine.acceptance
    assert proposed > 0 and 0 < accepted <= proposed
    assert engine.allocator.free == engine.allocator.capacity


def test_end_ids_end_a_speculating_row_where_plain_decoding_ends_it():
    """An end id met inside a run of kept drafts ends the row there, the end id its last token."""
    want = plain(GREEDY)
    end = int(want.ids[2][6])  # a token of the repetitive prompt's answer
    _, reqs = run(PROMPTS, GREEDY, eos=(end,), speculate=4)
    for r, ids in zip(reqs, want.ids):
        ids = ids.tolist()
        cut = ids[: ids.index(end) + 1] if end in ids else ids
        assert r.ids == cut and r.finish == ("eos" if end in ids else "length")


def test_sampled_and_greedy_rows_speculate_side_by_side():
    hot = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=8, seed=5)
    target, params, _, _ = models()
    engine = Engine(target, max_len=48, config=EngineConfig(slots=4, page_size=4, speculate=3))
    reqs = [Request(list(p), hot if i % 2 else GREEDY, eos=(-1,)) for i, p in enumerate(PROMPTS)]
    engine.run(params, reqs)
    want = plain(GREEDY)
    for i, r in enumerate(reqs):
        assert len(r.ids) == 16 and len(r.logps) == 16
        if i % 2 == 0:
            assert r.ids == want.ids[i].tolist()
    with pytest.raises(UserError, match="speculate=-1"):
        EngineConfig(speculate=-1)


# ---- the per-row acceptance, counted ----------------------------------------------------------

V, K, DRAWS = 6, 2, 20_000
LOGITS = jnp.log(jnp.asarray([[0.05, 0.40, 0.05, 0.20, 0.25, 0.05], [0.30, 0.10, 0.10, 0.10, 0.10, 0.30]] * 2))[None]
CRITICAL = 20.5  # chi-square with 5 degrees of freedom at p = 0.001


def test_each_row_keeps_drafts_by_its_own_settings():
    """Row 0 samples at temperature 1 with top-k 3, row 1 is greedy, both with the point-mass drafts
    prompt lookup makes: row 0's first token follows the top-3 renormalized distribution, row 1's
    is the argmax."""
    logits = jnp.concatenate([LOGITS[:, :3], LOGITS[:, :3]])  # [2 rows, k+1 = 3, V]
    settings = dict(
        temperature=jnp.asarray([1.0, 0.0]),
        top_k=jnp.asarray([3, 0]),
        top_p=jnp.ones(2),
        min_p=jnp.zeros(2),
    )
    p = row_probs(logits, settings)
    drafts = jnp.asarray([[3, 1], [3, 1]], jnp.int32)
    q = jax.nn.one_hot(drafts, V)

    def one(key):
        keys = jax.random.split(key, 2)
        n_acc, following = jax.vmap(accept_drafts)(keys, p, q, drafts, jnp.full(2, K, jnp.int32))
        return jnp.where(n_acc >= 1, drafts[:, 0], following)  # each row's first emitted token

    first = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), DRAWS)))
    top3 = np.asarray([0, 0.40, 0, 0.20, 0.25, 0]) / 0.85
    assert chi_square(np.bincount(first[:, 0], minlength=V), np.where(top3 > 0, top3, 1e-12)) < CRITICAL
    assert (first[:, 1] == 1).all()  # greedy: the argmax, whatever was drafted


def test_the_config_reaches_the_engine():
    target, _, _, _ = models()
    engine = Engine(target, max_len=48, config=dataclasses.replace(EngineConfig(slots=2), speculate=2))
    assert "history" in engine.state and engine.acceptance == (0, 0)


def test_lm_sample_draft_ngram_speculates_in_the_engine(export, capsys):  # noqa: F811
    args = ["sample", "--params", str(export), "--prompt", "def f(", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    plain_text = capsys.readouterr().out
    assert main([*args, "--draft", "ngram", "--draft-k", "3", "--batch-size", "2", "--kv-cache", "int8"]) == 0
    int8 = capsys.readouterr().out
    assert main([*args, "--draft", "ngram", "--draft-k", "3"]) == 0
    assert capsys.readouterr().out == plain_text and int8.startswith("def f(")
