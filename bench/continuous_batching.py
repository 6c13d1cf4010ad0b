"""Continuous vs static batching: useful new tokens/s for requests of mixed prompt and output lengths.

64 requests (prompts of 8-192 tokens, 16-384 new tokens each, drawn once with a fixed seed) on the
small Llama of decode_throughput.py, greedy. The engine (lm.infer.engine) decodes them through
`--slots` slots: a request leaves when its budget is spent and the next one takes its place. The
static peer (tests/reference/static_decoder.py, a dense KV cache) takes them `--slots` at a time in the same
order; every batch runs until its longest request is done, as a static batch must. Both count only
each request's own tokens. Rounds alternate between the two; medians are reported.

    PYTHONPATH=. python bench/continuous_batching.py [--rounds 3] [--requests 64] [--slots 16]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode_throughput import SHAPE, spec  # noqa: E402
from lm.infer.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402
from tests.reference.static_decoder import StaticGenerator  # noqa: E402


def workload(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 193, n)
    prompts = [rng.integers(3, SHAPE["vocab"], k).tolist() for k in lengths]
    return prompts, rng.integers(16, 385, n).tolist()


def run_engine(model, params, prompts, budgets, slots: int) -> tuple[float, int]:
    engine = Engine(model, max_len=model.spec.max_seq_len, config=EngineConfig(slots=slots))
    requests = [
        Request(p, SamplingParams(max_new_tokens=b, temperature=0), eos=(-1,)) for p, b in zip(prompts, budgets)
    ]
    start = time.perf_counter()
    engine.run(params, requests)
    wall = time.perf_counter() - start
    assert all(len(r.ids) == b for r, b in zip(requests, budgets))
    return wall, sum(budgets)


def run_static(model, params, prompts, budgets, slots: int, cache: dict) -> tuple[float, int]:
    start = time.perf_counter()
    for i in range(0, len(prompts), slots):
        longest = max(budgets[i : i + slots])
        if longest not in cache:
            cache[longest] = StaticGenerator(
                model, params, SamplingParams(max_new_tokens=longest, temperature=0), eos_id=-1
            )
        out = cache[longest](prompts[i : i + slots])
        assert all(len(ids) == longest for ids in out.ids)
    return time.perf_counter() - start, sum(budgets)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    args = p.parse_args()
    prompts, budgets = workload(args.requests)
    model = Transformer(spec(max(len(q) for q in prompts) + max(budgets)))
    params = jax.jit(lambda k: nn.unbox(init_params(model, k)))(jax.random.PRNGKey(0))
    cache: dict = {}
    run_engine(model, params, prompts, budgets, args.slots)  # compile every bucket
    run_static(model, params, prompts, budgets, args.slots, cache)
    engine, static = [], []
    for r in range(args.rounds):
        wall, tokens = run_engine(model, params, prompts, budgets, args.slots)
        engine.append(tokens / wall)
        wall, tokens = run_static(model, params, prompts, budgets, args.slots, cache)
        static.append(tokens / wall)
        print(
            f"round {r}: continuous {engine[-1]:.0f} tok/s, static {static[-1]:.0f} tok/s, "
            f"ratio {engine[-1] / static[-1]:.2f}",
            flush=True,
        )
    padded = sum(
        max(budgets[i : i + args.slots]) * len(budgets[i : i + args.slots]) for i in range(0, len(budgets), args.slots)
    )
    print(
        f"\n{args.requests} requests, {args.slots} slots, {sum(budgets)} useful new tokens "
        f"(a static batch decodes {padded} row-steps: {padded / sum(budgets):.2f}x)"
    )
    print(
        f"continuous {statistics.median(engine):.0f} tok/s, static {statistics.median(static):.0f} tok/s, "
        f"continuous / static (median of rounds) {statistics.median(e / s for e, s in zip(engine, static)):.2f}"
    )


if __name__ == "__main__":
    main()
