"""Prefix caching: keys are a hash chain; a request reuses the longest cached prefix of its prompt and
gets the tokens it gets without the cache, in a group admitted together, in later runs, in a pool
small enough that cached pages are overwritten, after the params change, and on a (2,2,2) mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import base_config, rules_table
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.engine.pool import init_pool, page_copier
from lm.infer.engine.prefix import PrefixCache
from lm.infer.sampling import SamplingParams
from lm.model.layers import Partitioning
from lm.model.transformer import Transformer
from lm.sharding import make_mesh, param_shardings
from tests.infer.test_generate import SPEC, model_params
from tests.model.test_transformer import random_params

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
SYSTEM = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]  # 13 tokens: 3 full pages of 4
PROMPTS = [SYSTEM + [5, 9], SYSTEM + [7], SYSTEM + [100, 3, 8], SYSTEM[:9] + [2], SYSTEM + [5, 9]]


def test_keys_chain_every_earlier_token():
    cache = PrefixCache(page_size=2)
    a, b = cache.keys([1, 2, 3, 4, 5], 2), cache.keys([9, 2, 3, 4], 2)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # page 2 holds the same tokens, not the same prefix
    assert cache.keys([1, 2, 3, 4], 2) == a
    cache.remember([1, 2, 3, 4, 5], [7, 8])
    assert cache.match(cache.keys([1, 2, 3, 4, 6], 2)) == [7, 8]
    assert cache.match(cache.keys([1, 2, 9, 4, 6], 2)) == [7]  # the chain stops at the first miss
    cache.forget([7])
    assert cache.match(cache.keys([1, 2, 3, 4, 6], 2)) == [] and len(cache) == 1
    cache.count(10, 2)
    assert cache.hit_rate == pytest.approx(0.4)


def engine(prefix: bool, **kw):
    model, _ = model_params()
    config = EngineConfig(slots=3, page_size=4, chunk=3, decode_block=4, prefix_cache=prefix, **kw)
    return Engine(model, max_len=40, config=config)


def run(e, params, prompts=PROMPTS):
    return e.run(params, [Request(list(p), GREEDY, eos=(-1,)) for p in prompts])


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.ids == w.ids
        np.testing.assert_allclose(g.logps, w.logps, atol=1e-4)


@pytest.mark.parametrize("pages", [0, 40], ids=["slot-major", "shared-pool"])
def test_cached_prefixes_give_the_tokens_of_prefilling_everything(pages):
    """A whole cached prompt is taken but for its last page: its last token is always prefilled."""
    _, params = model_params()
    want = run(engine(False, pages=pages), params)
    e = engine(True, pages=pages)
    first = run(e, params)  # 5 requests on 3 slots: the later ones wait for the first prefill
    assert_same(first, want)
    hits = e.prefix.stats["hit_tokens"]
    assert hits >= 3 * 4  # at least one request took the 3 system pages
    again = run(e, params)  # the same params: every prompt's full pages are cached now
    assert_same(again, want)
    assert e.prefix.stats["hit_tokens"] - hits == 3 * 4 * 4 + 2 * 4  # 4 prompts x 3 pages, one x 2 pages
    assert e.allocator.free == e.allocator.capacity and not e.busy


def test_a_pool_too_small_to_keep_them_overwrites_cached_pages():
    """A pool of 9 usable pages (two requests' worth): cached pages are handed out again and forgotten."""
    _, params = model_params()
    prompts = [SYSTEM + [i] for i in range(6)] + [[60 + i for i in range(14)], SYSTEM + [1]]
    want = run(engine(False, pages=10), params, prompts)
    e = engine(True, pages=10)
    got = run(e, params, prompts)
    assert_same(got, want)
    assert 0 < e.prefix.hit_rate < 1
    assert len(e.prefix) <= 9


def test_new_params_clear_the_cache():
    model, params = model_params()
    other = random_params(model, seed=8)
    e = engine(True)
    run(e, params, PROMPTS[:1])
    before = e.prefix.stats["hit_tokens"]
    got = run(e, other, PROMPTS[:1])  # the same prompt: its pages hold the old params' keys and values
    assert e.prefix.stats["hit_tokens"] == before
    assert_same(got, run(engine(False), other, PROMPTS[:1]))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_on_a_2x2x2_mesh_equals_one_device():
    model, params = model_params()
    want = run(engine(False), params)
    rules = rules_table(base_config())
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    sharded = Transformer(SPEC, Partitioning(mesh, rules))
    boxed = jax.eval_shape(lambda k: sharded.init(k, *(jnp.zeros((1, 4), jnp.int32),) * 3), jax.random.PRNGKey(0))
    placed = jax.device_put(params, param_shardings(boxed["params"], mesh, rules))
    config = dataclasses.replace(engine(True).config, slots=4)
    e = Engine(sharded, max_len=40, config=config, mesh=mesh, rules=rules)
    assert_same(run(e, placed), want)
    assert_same(run(e, placed), want)
    assert e.prefix.stats["hit_tokens"] > 3 * 4 * 4
    pool = init_pool(e.model, e.place)
    src, dst = (e.place.put(np.array(x, np.int32)) for x in ([1, 2], [3, 99]))
    copied = page_copier(e.model)(jax.tree.map(jnp.copy, pool), src, dst)
    for got, want in zip(jax.tree.leaves(copied), jax.tree.leaves(pool)):  # a copy keeps the pool's split
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_the_copier_reads_every_page_before_writing_any():
    e = engine(True, pages=6)
    pool = jax.tree.map(lambda x: jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), init_pool(e.model, e.place))
    src, dst = np.array([1, 2, 0], np.int32), np.array([2, 3, 6], np.int32)  # page 6 is past the pool: dropped
    copied = page_copier(e.model)(jax.tree.map(jnp.copy, pool), src, dst)
    rows = lambda p: slice(4 * p, 4 * p + 4)  # noqa: E731
    for got, was in zip(jax.tree.leaves(copied), jax.tree.leaves(pool)):
        got, was = np.asarray(got), np.asarray(was)
        want = was.copy()
        want[..., rows(2), :], want[..., rows(3), :] = was[..., rows(1), :], was[..., rows(2), :]
        np.testing.assert_array_equal(got, want)


def test_a_shared_pool_holds_a_cached_prefix_once_for_every_request_reading_it():
    """Three requests of one prompt need 3 x 5 pages; 13 free pages hold them all at once only if
    the 3 pages of their shared prefix are held once (by every request reading them) and not copied."""
    model, params = model_params()
    prompts = [SYSTEM + [i] for i in range(3)]  # 14 tokens + 6 new: 5 pages each, 3 of them the prefix
    want = run(engine(False, pages=14), params, prompts)
    e = engine(True, pages=14)
    seen = []

    def look(ids, logps):  # while tokens come out: who runs, which pages they share
        running = [r for r in e.running if r is not None]
        shared = set.intersection(*(set(r.pages) for r in running))
        seen.append((len(running), shared, [e.allocator.holders(p) for p in shared], e.allocator.free))

    requests = [Request(list(p), GREEDY, eos=(-1,), on_tokens=look) for p in prompts]
    assert_same(e.run(params, requests), want)
    running, shared, holders, free = max(seen, key=lambda x: x[0])
    assert running == 3 and len(shared) == 3 and holders == [3, 3, 3] and free == 13 - 3 - 3 * 2
    assert e.prefix.stats["hit_tokens"] == 2 * 3 * 4 and e.prefix.owed == 0
    assert e.allocator.free == e.allocator.capacity and all(e.allocator.holders(p) == 0 for p in range(14))
    assert len(e.prefix) >= 3  # released pages keep their keys until they are handed out again
