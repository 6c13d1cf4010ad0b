"""`lm serve` under load: many streaming clients against one server, over HTTP with the openai client.

The server runs in this process (a thread) on 127.0.0.1 over the backend `lm serve` builds
(`make_backend`), on a trained run or export (--workdir/--params, e.g. runs/demo-hf/sft) or on a
small random model built here. 64 client threads send 256 streamed completions between them:
every prompt starts with the same system prompt (`--system` characters), then one of 3 lengths
of text, with max_tokens of 3 sizes mixed, sampled at temperature 0.8 with a seed per request.
Each request has a timeout and the whole load a deadline; every request must come back with a
finish reason (a lost one makes the exit status 1). `--compare` runs the same load twice, the
server's prefix cache off, then on (the before and after of prefix caching).

    PYTHONPATH=. python bench/serve_load.py [--workdir RUN | --params EXPORT] [--requests 256]
        [--clients 64] [--system 120] [--deadline 600] [--compare]

Prints the warm-up time (compiling the shapes the load will use), then per load: requests/s,
generated tokens/s, time to first token (until the first chunk holding text) and inter-token
latency (the gaps between a stream's text chunks, each shared by the tokens it brings) at p50
and p99, and the whole latency. Asserts nothing else.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import openai  # noqa: E402

from lm.infer.serve.app import make_app  # noqa: E402
from lm.infer.serve.engine_backend import make_backend  # noqa: E402
from lm.infer.serve.server import InThread  # noqa: E402

TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
)
SYSTEM = "You are a careful assistant for Python code. Answer with code only, no prose. " * 4
PROMPT_CHARS = (12, 40, 100)  # after the system prompt; byte-level tokenizers: as many tokens
MAX_TOKENS = (16, 48, 96)


def random_model():
    """A small random-weight model with the byte tokenizer (no training; the figures are the server's)."""
    import flax.linen as nn
    import jax

    from lm.config import base_config
    from lm.data.tokenizer import ByteTokenizer
    from lm.model.spec import ModelSpec
    from lm.model.transformer import Transformer, init_params
    from lm.store.loaded import Loaded

    c = base_config()
    c.model.update(vocab_size=264, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=512)
    c.data.update(tokenizer="byte", seq_len=512)
    params = nn.unbox(init_params(Transformer(ModelSpec.from_config(c.model)), jax.random.key(0)))
    return Loaded(c, jax.tree.map(np.asarray, params), ByteTokenizer(), "random model")


def one(client, model: str, i: int, timeout: float, system: str) -> dict:
    """Request i (its prompt and max_tokens from i): latency, time to first text, the gaps between
    text chunks (each per token it brings), tokens, finish."""
    prompt, max_tokens = system + TEXT[: PROMPT_CHARS[i % 3]], MAX_TOKENS[(i // 3) % 3]
    start, first, finish, tokens = time.perf_counter(), None, None, 0
    arrivals = []
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.8,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        timeout=timeout,
    ):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append((time.perf_counter(), len(chunk.choices[0].text)))
            first = arrivals[0][0] - start
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    # byte-level tokenizers: a chunk's characters are about its tokens
    gaps = [(b - a) / n for (a, _), (b, n) in zip(arrivals, arrivals[1:]) for _ in range(n)]
    return {"latency": time.perf_counter() - start, "ttft": first, "gaps": gaps, "tokens": tokens, "finish": finish}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def load(loaded, name: str, args, prefix_cache: bool) -> tuple[dict, list]:
    """One server with the prefix cache on or off, warmed up, then the load: (figures, errors)."""
    backend = make_backend(
        loaded,
        argparse.Namespace(
            quantize="none",
            slots=args.clients,
            page_size=16,
            max_model_len=None,
            model_name=name,
            no_prefix_cache=not prefix_cache,
        ),
    )
    with InThread(make_app(backend), grace=1.0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        t0 = time.perf_counter()
        for i in range(9):  # every prompt length and max_tokens once: the compiles, not timed below
            one(client, name, i, args.timeout, "")
            one(client, name, i, args.timeout, args.system_text)
        warm = time.perf_counter() - t0

        results, errors, lock = {}, [], threading.Lock()
        next_i = iter(range(args.requests))
        deadline = time.perf_counter() + args.deadline

        def client_loop():
            while time.perf_counter() < deadline:
                with lock:
                    i = next(next_i, None)
                if i is None:
                    return
                try:
                    timeout = min(args.timeout, max(1.0, deadline - time.perf_counter()))
                    result = one(client, name, i, timeout, args.system_text)
                except Exception as e:  # noqa: BLE001 (counted and shown)
                    with lock:
                        errors.append(f"request {i}: {type(e).__name__}: {e}")
                    continue
                with lock:
                    results[i] = result

        threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()) + 5)
        wall = time.perf_counter() - start
        hit_rate = backend.load().prefix_hit_rate
    backend.shutdown(cancel=True)
    done = [r for r in results.values() if r["finish"] in ("stop", "length")]
    gaps = [g for r in done for g in r["gaps"]]
    ttft, latency = [r["ttft"] for r in done if r["ttft"] is not None], [r["latency"] for r in done]
    return {
        "cache": "on" if prefix_cache else "off",
        "warm_s": warm,
        "answered": len(done),
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "tokens_per_s": sum(r["tokens"] for r in done) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(gaps, 50),
        "itl_p99": pct(gaps, 99),
        "latency_p50": pct(latency, 50),
        "latency_p99": pct(latency, 99),
        "hit_rate": hit_rate,
    }, errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workdir")
    src.add_argument("--params")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--system", type=int, default=len(SYSTEM), help="characters of the shared system prompt")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds for one whole load")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one request")
    p.add_argument("--compare", action="store_true", help="the load with the prefix cache off, then on")
    args = p.parse_args()
    args.system_text = (SYSTEM * (1 + args.system // len(SYSTEM)))[: args.system]

    t0 = time.perf_counter()
    if args.workdir or args.params:
        from lm.store.load import load_trained

        loaded = load_trained(args.workdir, args.params)
    else:
        loaded = random_model()
    name = args.workdir or args.params or "random"
    print(f"model: {loaded.source}; loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    print(
        f"{args.requests} streamed requests from {args.clients} clients, a shared system prompt of "
        f"{args.system} characters"
    )
    print(
        "| prefix cache | answered | requests/s | tokens/s | first token p50 / p99 s | inter-token p50 / p99 ms "
        "| latency p50 / p99 s | prompt tokens cached | warm-up s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lost = 0
    for on in (False, True) if args.compare else (True,):
        f, errors = load(loaded, name, args, on)
        lost += args.requests - f["answered"]
        print(
            f"| {f['cache']} | {f['answered']}/{args.requests} | {f['requests_per_s']:.2f} | {f['tokens_per_s']:.1f} "
            f"| {f['ttft_p50']:.3f} / {f['ttft_p99']:.3f} | {1e3 * f['itl_p50']:.1f} / {1e3 * f['itl_p99']:.1f} "
            f"| {f['latency_p50']:.3f} / {f['latency_p99']:.3f} | {f['hit_rate']:.0%} | {f['warm_s']:.1f} |",
            flush=True,
        )
        for e in errors[:5]:
            print("  " + e)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
