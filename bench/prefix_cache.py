"""Prefix caching: time to first token when prompts share a prefix, and a GRPO-style group.

The small Llama of decode_throughput.py (random weights, greedy). For each shared share of a
`--prompt`-token prompt (0, 50 and 90%), every request is the shared prefix plus its own random
tail; an engine with `EngineConfig(prefix_cache=...)` on or off has already served one request with
that prefix, then a new request's time to its first token (max_new_tokens=1: prefill and the
first pending token) is measured. A group: G samples of one prompt admitted together, each
`--new` tokens (the later samples wait for the first prefill, then copy its pages into their own
slot-major pages, or in a shared pool (`EngineConfig.pages` > 0) read the very same pages: the
peak of pages held shows what sharing saves). Rounds alternate cache on and off; medians, the
on/off ratio and the hit rate (prompt tokens not prefilled) are printed. Asserts that all give the
same greedy tokens; nothing about time.

    PYTHONPATH=. python bench/prefix_cache.py [--prompt 512] [--rounds 3] [--group 8] [--new 32]
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
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode_throughput import SHAPE, spec  # noqa: E402
from lm.infer.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402


def timed(engine, params, prompts, new: int, peak=None):
    """(seconds, greedy ids); `peak` (a list) gets the most pages held while tokens came out."""
    held = lambda *_: peak.append(engine.allocator.capacity - engine.allocator.free)  # noqa: E731
    sampling = SamplingParams(max_new_tokens=new, temperature=0)
    requests = [Request(list(p), sampling, eos=(-1,), on_tokens=held if peak is not None else None) for p in prompts]
    start = time.perf_counter()
    engine.run(params, requests)
    return time.perf_counter() - start, [r.ids for r in requests]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    a = p.parse_args()
    model = Transformer(spec(a.prompt + a.new + 16))
    params = init_params(model, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(3, SHAPE["vocab"], n).tolist()  # noqa: E731
    engines = {
        on: Engine(model, max_len=model.spec.max_seq_len, config=EngineConfig(slots=a.group, prefix_cache=on))
        for on in (False, True)
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; prompt {a.prompt} tokens; {a.rounds} rounds")
    print("| shared prefix | first token, cache off | cache on | on/off | hit rate |")
    print("|---|---:|---:|---:|---:|")
    for share in (0.0, 0.5, 0.9):
        prefix = tokens(int(share * a.prompt))
        times, hits = {False: [], True: []}, []
        for round_ in range(a.rounds + 1):  # round 0 compiles both engines' shapes
            tail = tokens(a.prompt - len(prefix))
            for on, engine in engines.items():
                timed(engine, params, [prefix + tokens(a.prompt - len(prefix))], 1)  # the prefix is served once
                before = dict(engine.prefix.stats) if on else None
                took, ids = timed(engine, params, [prefix + tail], 1)
                if round_:
                    times[on].append(took)
                if on:
                    seen = engine.prefix.stats["prompt_tokens"] - before["prompt_tokens"]
                    hits.append((engine.prefix.stats["hit_tokens"] - before["hit_tokens"]) / seen)
                else:
                    want = ids
            assert ids == want, "the cache changed a greedy token"
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {share:.0%} | {1e3 * off:.1f} ms | {1e3 * on:.1f} ms | {on / off:.2f} | {hits[-1]:.0%} |")
    pages = a.group * engines[True].table_width + 1  # a shared pool as large as the slot-major one
    pooled = Engine(model, max_len=model.spec.max_seq_len, config=EngineConfig(slots=a.group, pages=pages))
    runs = {"cache off": engines[False], "cache on (copies)": engines[True], "cache on, shared pool": pooled}
    group, peaks = {name: [] for name in runs}, {name: [] for name in runs}
    for round_ in range(a.rounds + 1):
        prompt = tokens(a.prompt)
        for name, engine in runs.items():
            took, ids = timed(engine, params, [prompt] * a.group, a.new, peaks[name])
            group[name].append(took) if round_ else None
            want = ids if name == "cache off" else want
            assert ids == want, "the cache changed a greedy token"
    rate = a.group * a.new
    print(f"\ngroup of {a.group} samples of one {a.prompt}-token prompt, {a.new} new tokens each:")
    print("| engine | time | tok/s | vs cache off | most pages held | hit rate |")
    print("|---|---:|---:|---:|---:|---:|")
    off = statistics.median(group["cache off"])
    for name, engine in runs.items():
        t = statistics.median(group[name])
        hit = f"{engine.prefix.hit_rate:.0%}" if engine.prefix is not None else "-"
        print(f"| {name} | {1e3 * t:.0f} ms | {rate / t:.0f} | {t / off:.2f} | {max(peaks[name])} | {hit} |")


if __name__ == "__main__":
    main()
