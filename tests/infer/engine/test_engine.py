"""The engine: continuous batching over a paged KV pool gives each request the tokens of the static
dense-cache decoder, whatever else is in the batch; pages come back; int8 pages; cancels."""

import dataclasses

import numpy as np
import pytest

from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request, bucket
from lm.infer.engine.pool import pool_bytes
from lm.infer.sampling import SamplingParams
from tests.infer.test_generate import model_params
from tests.reference.static_decoder import StaticGenerator

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
HOT = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=3)
PROMPTS = [
    [5, 9, 13, 2],
    [7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
    [100, 3],
    [8, 8, 8],
    [1, 2, 3, 4, 5],
]


def static_greedy(prompts, n=GREEDY.max_new_tokens):
    model, params = model_params()
    return StaticGenerator(model, params, dataclasses.replace(GREEDY, max_new_tokens=n), eos_id=-1)(prompts)


def requests(samplings, prompts=PROMPTS):
    return [Request(list(p), s, eos=(-1,)) for p, s in zip(prompts, samplings)]


def test_greedy_requests_equal_the_static_decoder_in_any_mix():
    """3 slots for 6 requests (they queue and join as others leave), prompts prefilled in chunks of 3
    over pages of 4 tokens, greedy and sampled requests of different lengths side by side."""
    model, params = model_params()
    lengths = [10, 3, 7, 10, 1, 5]
    samplings = [dataclasses.replace(GREEDY if i % 2 == 0 else HOT, max_new_tokens=n) for i, n in enumerate(lengths)]
    engine = Engine(model, max_len=40, config=EngineConfig(slots=3, page_size=4, chunk=3, decode_block=4))
    done = engine.run(params, requests(samplings))
    ref = static_greedy(PROMPTS)
    for i, r in enumerate(done):
        assert len(r.ids) == lengths[i] and r.finish == "length"
        if i % 2 == 0:
            assert r.ids == ref.ids[i][: lengths[i]].tolist()
            np.testing.assert_allclose(r.logps, ref.logprobs[i][: lengths[i]], atol=1e-4)
    assert engine.allocator.free == engine.allocator.capacity  # every page came back
    assert not engine.busy


def test_a_request_added_mid_flight_and_a_small_pool():
    """A pool with room for two requests at a time: the others wait for pages, then join."""
    model, params = model_params()
    engine = Engine(model, max_len=40, config=EngineConfig(slots=4, page_size=4, pages=1 + 2 * 4, decode_block=2))
    first = requests([GREEDY] * 3, PROMPTS[:3])
    for r in first:
        engine.add(r)
    prepared = engine.prepare(params)
    engine.step(prepared)
    assert sum(r is not None for r in engine.running) == 2 and len(engine.waiting) == 1  # out of pages
    late = requests([GREEDY], PROMPTS[3:4])[0]
    engine.add(late)
    while engine.busy:
        engine.step(prepared)
    ref = static_greedy(PROMPTS[:4])
    for r, ids in zip(first + [late], ref.ids):
        assert r.ids == ids.tolist()


def test_sampled_tokens_do_not_depend_on_the_batch():
    model, params = model_params()
    alone = Engine(model, max_len=40, config=EngineConfig(slots=1)).run(params, requests([HOT], PROMPTS[:1]))[0]
    engine = Engine(model, max_len=40, config=EngineConfig(slots=4, page_size=8))
    mixed = engine.run(params, requests([GREEDY, HOT, HOT], [PROMPTS[2], PROMPTS[0], PROMPTS[1]]))
    assert mixed[1].ids == alone.ids
    np.testing.assert_allclose(mixed[1].logps, alone.logps, atol=1e-5)
    assert mixed[2].ids != alone.ids  # another prompt, another stream
    other_seed = Engine(model, max_len=40, config=EngineConfig(slots=1)).run(
        params, requests([dataclasses.replace(HOT, seed=4)], PROMPTS[:1])
    )[0]
    assert other_seed.ids != alone.ids


def test_end_ids_callbacks_and_cancel_free_their_pages():
    model, params = model_params()
    free = static_greedy(PROMPTS[:3], 10)
    eos = int(free.ids[0][2])
    engine = Engine(model, max_len=40, config=EngineConfig(slots=3, page_size=4, decode_block=3, idle_block=3))
    seen = []
    stopper = Request(list(PROMPTS[1]), GREEDY, eos=(-1,), on_tokens=lambda ids, lp: seen.append(len(ids)) or True)
    cancelled = Request(list(PROMPTS[2]), GREEDY, eos=(-1,))
    cancelled.cancelled = True
    ended = Request(list(PROMPTS[0]), GREEDY, eos=(eos,))
    engine.run(params, [ended, stopper, cancelled])
    assert ended.finish == "eos" and ended.ids == free.ids[0][:3].tolist()
    assert stopper.finish == "stop" and len(stopper.ids) == seen[0] == 3  # one decode block, then stopped
    assert cancelled.finish == "cancelled" and cancelled.ids == []
    assert engine.allocator.free == engine.allocator.capacity


@pytest.mark.parametrize(
    "kv, ratio",
    [
        (
            "int8",
            (8 + 4) / (8 * 4),
        ),  # float32 test model: 4 bytes per value -> 1 byte plus a 4-byte scale per 8-value head
        ("fp8", 1 / 4),  # 1 byte per value, no scale
    ],
)
def test_small_pages_shrink_the_pool_and_stay_close(kv, ratio):
    model, params = model_params()
    dense = Engine(model, max_len=40, config=EngineConfig(slots=2, page_size=8))
    small = Engine(model, max_len=40, config=EngineConfig(slots=2, page_size=8, kv_cache=kv))
    a = dense.run(params, requests([GREEDY] * 2, PROMPTS[:2]))
    b = small.run(params, requests([GREEDY] * 2, PROMPTS[:2]))
    assert pool_bytes(small.pool) / pool_bytes(dense.pool) == pytest.approx(ratio)
    # rounding moves log-probs (fp8's 3 mantissa bits more than int8's 7), rarely the first token
    assert a[0].ids[0] == b[0].ids[0] and a[1].ids[0] == b[1].ids[0]
    np.testing.assert_allclose([b[0].logps[0], b[1].logps[0]], [a[0].logps[0], a[1].logps[0]], atol=0.1)


def test_refusals_name_the_request():
    model, params = model_params()
    engine = Engine(model, max_len=40, config=EngineConfig(slots=2, page_size=4, pages=3))
    with pytest.raises(UserError, match="needs 4 pages of 4 tokens; the pool has 2"):
        engine.add(Request([1] * 6, GREEDY, eos=(-1,)))
    with pytest.raises(UserError, match="exceed the context of 40"):
        engine.add(Request([1] * 35, GREEDY, eos=(-1,)))
    with pytest.raises(UserError, match="slots=0"):
        EngineConfig(slots=0)
    assert bucket(5, 1, 64) == 8 and bucket(100, 16, 64) == 64 and bucket(3, 16, 256) == 16


@pytest.mark.parametrize("every", [1, 4])
def test_a_decode_call_ends_when_a_row_ends(every):
    """Nothing waits, the step budget is large: the call still returns as soon as a row ends (after
    the fixed count of steps between the loop's checks), and the tokens are the static decoder's
    whatever that count."""
    model, params = model_params()
    config = EngineConfig(slots=3, page_size=4, decode_block=64, idle_block=64, check_every=every)
    engine = Engine(model, max_len=40, config=config)
    lengths = [3, 7, 10]
    reqs = requests([dataclasses.replace(GREEDY, max_new_tokens=n) for n in lengths], PROMPTS[:3])
    for r in reqs:
        engine.add(r)
    params = engine.prepare(params)
    engine.step(params)  # prefill, then one decode call
    assert [r.finish for r in reqs] == ["length", None, None]
    assert [len(r.ids) for r in reqs] == [3, max(3, every), max(3, every)]
    while engine.busy:
        engine.step(params)
    ref = static_greedy(PROMPTS[:3])
    for r, n, want in zip(reqs, lengths, ref.ids):
        assert r.ids == want[:n].tolist()
    assert engine.device_s > 0
