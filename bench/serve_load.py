"""`lm serve` under load: many streaming clients against one server, over HTTP with the openai client.

The server runs in this process (a thread) on 127.0.0.1 over the backend `lm serve` builds
(`make_backend`), on a trained run or export (--workdir/--params, e.g. runs/demo-hf/sft) or on a
small random model built here. 16 client threads send 200 streamed completions between them,
with prompts of 3 lengths and max_tokens of 3 sizes mixed, sampled at temperature 0.8 with a
seed per request. Each request has a timeout and the whole load a deadline; every request must
come back with a finish reason (a lost one makes the exit status 1).

    PYTHONPATH=. python bench/serve_load.py [--workdir RUN | --params EXPORT] [--requests 200]
        [--clients 16] [--deadline 600]

Prints the warm-up time (compiling the shapes the load will use, one request each), then
requests/s, generated tokens/s, latency p50/p99 and time to first token p50/p99 (until the
first chunk holding text). Asserts nothing else.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
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
PROMPT_CHARS = (12, 40, 100)  # byte-level tokenizers: as many tokens (+ BOS where the tokenizer adds one)
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
    c.model.update(vocab_size=264, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256)
    c.data.update(tokenizer="byte", seq_len=256)
    params = nn.unbox(init_params(Transformer(ModelSpec.from_config(c.model)), jax.random.key(0)))
    return Loaded(c, jax.tree.map(np.asarray, params), ByteTokenizer(), "random model")


def one(client, model: str, i: int, timeout: float) -> dict:
    """Request i (its prompt and max_tokens from i): latency, time to first text, tokens, finish."""
    prompt, max_tokens = TEXT[: PROMPT_CHARS[i % 3]], MAX_TOKENS[(i // 3) % 3]
    start, first, finish, tokens = time.perf_counter(), None, None, 0
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
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens, "finish": finish}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workdir")
    src.add_argument("--params")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole load")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one request")
    args = p.parse_args()

    t0 = time.perf_counter()
    if args.workdir or args.params:
        from lm.store.load import load_trained

        loaded = load_trained(args.workdir, args.params)
    else:
        loaded = random_model()
    name = args.workdir or args.params or "random"
    backend = make_backend(
        loaded,
        argparse.Namespace(quantize="none", slots=args.clients, page_size=16, max_model_len=None, model_name=name),
    )
    print(f"model: {loaded.source}; loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    with InThread(make_app(backend), grace=1.0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        t0 = time.perf_counter()
        for i in range(9):  # every prompt length and max_tokens once: the compiles, not timed below
            one(client, name, i, args.timeout)
        print(f"warm-up (9 requests, compiles included): {time.perf_counter() - t0:.1f} s", flush=True)

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
                    result = one(client, name, i, min(args.timeout, max(1.0, deadline - time.perf_counter())))
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
    backend.shutdown(cancel=True)

    done = [r for r in results.values() if r["finish"] in ("stop", "length")]
    lost = args.requests - len(done)
    tokens = sum(r["tokens"] for r in done)
    latency, ttft = [r["latency"] for r in done], [r["ttft"] for r in done if r["ttft"] is not None]
    print(
        f"{len(done)}/{args.requests} requests answered by {args.clients} clients in {wall:.1f} s "
        f"({lost} lost, {len(errors)} errors)"
    )
    print(
        f"requests/s: {len(done) / wall:.2f}   generated tokens/s: {tokens / wall:.1f}   "
        f"tokens/request: {statistics.mean([r['tokens'] for r in done]) if done else 0:.1f}"
    )
    print(
        f"latency s: p50 {pct(latency, 50):.3f}  p99 {pct(latency, 99):.3f}   "
        f"time to first token s: p50 {pct(ttft, 50):.3f}  p99 {pct(ttft, 99):.3f}"
    )
    for e in errors[:5]:
        print("  " + e)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
