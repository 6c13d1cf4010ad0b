"""Draft-model speculation inside the engine: greedy tokens and log-probs equal to plain decoding
(prompts queueing for slots and pages, prefixes cached and shared or copied, both pools under one
page table), sampled rows distributed as the target's (counted, with a draft whose distribution
differs), a (2,2,2) mesh equal to one device, and the one-line refusals."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from lm.config import base_config, rules_table
from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams, filter_logits
from lm.model.apply import logits_of
from lm.model.layers import Partitioning
from lm.model.transformer import Transformer
from lm.sharding import make_mesh, param_shardings
from tests.model.test_transformer import model_spec, random_params

TARGET = model_spec(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=48, init_std=0.3
)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)
SYSTEM = list(range(40, 49))  # 9 tokens: two full pages of 4, shared by three prompts
# a repetitive prompt, a one-token prompt, one that fills the context (32 + 16 = 48), shared prefixes
PROMPTS = [[5, 9, 13, 2], [7], [1, 2, 3, 4] * 4, list(range(3, 35)), SYSTEM + [5, 9], SYSTEM + [7], SYSTEM + [5, 9]]


@functools.cache
def models():
    """The target, and a draft that agrees with it about half the time: the target's first layer
    alone (a smaller model with its vocabulary), the target's second layer damped so it often
    leaves the first layer's choice as it is."""
    target = Transformer(TARGET)
    params = random_params(target, seed=1)
    damp = lambda path, x: x.at[1].multiply(0.3) if path[-1].key in ("wo", "w_down") else x  # noqa: E731
    params = jax.tree_util.tree_map_with_path(damp, params)
    draft = Transformer(dataclasses.replace(TARGET, n_layers=1))
    draft_params = params | {"blocks": jax.tree.map(lambda x: x[:1], params["blocks"])}
    return target, params, draft, draft_params


@functools.cache
def plain(sampling, prompts=tuple(map(tuple, PROMPTS))):
    target, params, _, _ = models()
    return Generator(target, params, sampling, eos_id=-1)([list(p) for p in prompts])


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic of counts against the probabilities p (the cells with p > 0)."""
    expected = counts.sum() * p
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("every, pages", [(1, 30), (3, 30), (3, 0)])
def test_greedy_with_a_draft_model_equals_plain_decoding(every, pages):
    """Seven prompts through three slots; pages=30 leaves too few pages for three long requests at
    once (they also wait for pages) and shares cached prefix pages, pages=0 copies them."""
    target, params, draft, draft_params = models()
    config = EngineConfig(slots=3, page_size=4, chunk=8, decode_block=4, idle_block=8, pages=pages)
    engine = Engine(target, max_len=48, config=dataclasses.replace(config, speculate=3, check_every=every), draft=draft)
    reqs = engine.run((params, draft_params), [Request(list(p), GREEDY, eos=(-1,)) for p in PROMPTS])
    want = plain(GREEDY)
    for r, ids, logps in zip(reqs, want.ids, want.logprobs):
        assert r.ids == ids.tolist() and r.finish == "length"
        np.testing.assert_allclose(r.logps, logps, rtol=1e-4, atol=1e-4)
    proposed, accepted = engine.acceptance
    assert 0 < accepted < proposed  # drafts both kept and rejected
    assert engine.prefix.stats["hit_tokens"] >= 2 * 4  # a cached prefix was taken
    assert engine.allocator.free == engine.allocator.capacity and not engine.busy


def test_end_ids_end_a_row_where_plain_decoding_ends_it():
    target, params, draft, draft_params = models()
    want = plain(GREEDY)
    end = int(want.ids[2][6])
    engine = Engine(target, max_len=48, config=EngineConfig(slots=4, page_size=4, speculate=4), draft=draft)
    reqs = engine.run((params, draft_params), [Request(list(p), GREEDY, eos=(end,)) for p in PROMPTS])
    for r, ids in zip(reqs, want.ids):
        ids = ids.tolist()
        cut = ids[: ids.index(end) + 1] if end in ids else ids
        assert r.ids == cut and r.finish == ("eos" if end in ids else "length")


# ---- sampled rows, counted ------------------------------------------------------------------

HOT = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3)
PROMPT, DRAWS = [5, 9, 13], 2000


def _filtered(model, params, sequences) -> np.ndarray:
    """The distributions [n, V] HOT draws the next token of each sequence from."""
    ids = jnp.asarray(sequences, jnp.int32)
    batch = dict(
        inputs=ids, segment_ids=jnp.ones_like(ids), positions=jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    )
    logits = logits_of(model, params, batch)[:, -1].astype(jnp.float32)
    return np.asarray(jax.nn.softmax(filter_logits(logits, HOT), axis=-1), np.float64)


def _joint(model, params) -> dict:
    """The probability of every 3-token continuation of PROMPT under HOT (the ones above 0)."""
    joint = {(): 1.0}
    for _ in range(HOT.max_new_tokens):
        prefixes = list(joint)
        probs = _filtered(model, params, [PROMPT + list(c) for c in prefixes])
        joint = {c + (t,): joint[c] * p[t] for c, p in zip(prefixes, probs) for t in np.flatnonzero(p)}
    return joint


def test_sampled_rows_follow_the_target_distribution():
    """2000 requests of one prompt, each with its own key: the counts of their 3-token answers
    (first token from the prefill, then draft-model drafts kept or resampled, and the bonus
    token) against the target's exact joint distribution; the draft's differs from it."""
    target, params, draft, draft_params = models()
    p, q = _joint(target, params), _joint(draft, draft_params)
    assert sum(abs(p.get(c, 0) - q.get(c, 0)) for c in set(p) | set(q)) / 2 > 0.2  # the test has power
    keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(7), i))(np.arange(DRAWS)), np.uint32)
    config = EngineConfig(slots=128, page_size=4, decode_block=2, idle_block=2, speculate=2)
    engine = Engine(target, max_len=8, config=config, draft=draft)
    reqs = engine.run((params, draft_params), [Request(PROMPT, HOT, eos=(-1,), key=k) for k in keys])
    seen = [tuple(r.ids) for r in reqs]
    assert all(c in p for c in seen)  # every answer within the filters
    cells = sorted(p)
    counts = np.asarray([seen.count(c) for c in cells], np.float64)
    assert chi_square(counts, np.asarray([p[c] for c in cells])) < chi2.ppf(0.999, len(cells) - 1)
    proposed, accepted = engine.acceptance
    assert 0.2 < accepted / proposed < 0.95


# ---- a mesh, refusals -------------------------------------------------------------------------


def _on_mesh(model, params, mesh, rules):
    sharded = model.clone(part=Partitioning(mesh, rules))
    boxed = jax.eval_shape(lambda k: sharded.init(k, *(jnp.zeros((1, 4), jnp.int32),) * 3), jax.random.PRNGKey(0))
    return sharded, jax.device_put(params, param_shardings(boxed["params"], mesh, rules))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_on_a_2x2x2_mesh_equals_one_device():
    target, params, draft, draft_params = models()
    rules = rules_table(base_config())
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    (t, tp), (d, dp) = _on_mesh(target, params, mesh, rules), _on_mesh(draft, draft_params, mesh, rules)
    config = EngineConfig(slots=4, page_size=4, chunk=8, decode_block=4, speculate=3)
    engine = Engine(t, max_len=48, config=config, mesh=mesh, rules=rules, draft=d)
    reqs = engine.run((tp, dp), [Request(list(p), GREEDY, eos=(-1,)) for p in PROMPTS])
    want = plain(GREEDY)
    for r, ids, logps in zip(reqs, want.ids, want.logprobs):
        assert r.ids == ids.tolist()
        np.testing.assert_allclose(r.logps, logps, rtol=1e-4, atol=1e-4)
    assert engine.acceptance[1] > 0


def test_a_draft_that_cannot_propose_is_refused_in_one_line():
    target, params, draft, draft_params = models()
    config = EngineConfig(slots=2, page_size=4, speculate=2)
    other = Transformer(dataclasses.replace(TARGET, vocab_size=80, n_layers=1))
    with pytest.raises(UserError, match="vocabulary of 80 tokens, the target's has 64"):
        Engine(target, max_len=48, config=config, draft=other)
    short = Transformer(dataclasses.replace(TARGET, max_seq_len=24, n_layers=1))
    with pytest.raises(UserError, match="context of 24 positions, generation needs 48"):
        Engine(target, max_len=48, config=config, draft=short)
    with pytest.raises(UserError, match="needs speculate >= 1"):
        Engine(target, max_len=48, config=dataclasses.replace(config, speculate=0), draft=draft)
    with pytest.raises(TypeError, match="takes \\(target params, draft params\\)"):
        Engine(target, max_len=48, config=config, draft=draft).prepare(params)
