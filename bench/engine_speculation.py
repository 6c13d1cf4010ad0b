"""Speculation inside the engine (prompt-lookup drafts for every row, verified in one target pass
over the paged pool) against the plain engine: new tokens/s at batch 1 and 8, drafts kept.

Target: a random-weight Llama (--d-model, --layers; vocabulary 2048, float32 unless --dtype),
greedy, 64-token prompts made of a repeated random phrase (what prompt lookup feeds on: code,
retrieval, edits, and a random model's own greedy text, which repeats itself), --new-tokens each.
Drafts cost nothing next to the target, so the target's cost per call over k+1 tokens against 1
token decides the ratio. Plain and speculative runs alternate in rounds (the machine's speed
drifts); medians are reported with the median of the per-round ratios. Every speculative run is
checked to return the plain run's tokens.

    PYTHONPATH=. python bench/engine_speculation.py [--rounds 3] [--k 2 4] [--d-model 512 --layers 8]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config  # noqa: E402
from lm.infer.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402

VOCAB, PROMPT = 2048, 64


def target(d_model: int, layers: int, max_len: int, dtype: str):
    m = base_config().model
    m.update(
        vocab_size=VOCAB,
        d_model=d_model,
        n_layers=layers,
        n_heads=max(1, d_model // 64),
        n_kv_heads=max(1, d_model // 256),
        d_ff=d_model * 8 // 3 // 64 * 64,
        max_seq_len=max_len,
        compute_dtype=dtype,
    )
    model = Transformer(ModelSpec.from_config(m))
    cast = jnp.dtype(dtype)
    params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(cast), nn.unbox(init_params(model, k))))(
        jax.random.PRNGKey(0)
    )
    return model, params


def prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    phrases = rng.integers(3, VOCAB, (batch, 12))
    return [np.tile(p, PROMPT // 12 + 1)[:PROMPT].tolist() for p in phrases]


def decode(model, params, batch: int, new: int, k: int) -> tuple[float, list, tuple[int, int]]:
    config = EngineConfig(slots=batch, speculate=k)
    engine = Engine(model, max_len=PROMPT + new, config=config)
    reqs = [Request(p, SamplingParams(max_new_tokens=new, temperature=0), eos=(-1,)) for p in prompts(batch)]
    start = time.perf_counter()
    engine.run(params, reqs)
    return batch * new / (time.perf_counter() - start), [r.ids for r in reqs], engine.acceptance


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    model, params = target(args.d_model, args.layers, PROMPT + args.new_tokens, args.dtype)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"target: {n_params / 1e6:.1f}M params, d_model {args.d_model}, {args.layers} layers, {args.dtype}")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        runs = {k: [] for k in [0, *args.k]}
        want = decode(model, params, batch, args.new_tokens, 0)[1]  # compile, and the tokens to match
        kept = {}
        for k in args.k:
            _, ids, kept[k] = decode(model, params, batch, args.new_tokens, k)
            assert ids == want, f"k={k}: speculation changed the greedy tokens"
        for _ in range(args.rounds):
            for k in runs:
                runs[k].append(decode(model, params, batch, args.new_tokens, k)[0])
        for k in args.k:
            proposed, accepted = kept[k]
            row = dict(
                batch=batch,
                k=k,
                plain_tokens_per_s=statistics.median(runs[0]),
                tokens_per_s=statistics.median(runs[k]),
                vs_plain=statistics.median(s / p for s, p in zip(runs[k], runs[0])),
                kept=accepted / max(proposed, 1),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'batch':>5} {'k':>2} {'plain tok/s':>11} {'spec tok/s':>10} {'x plain':>7} {'kept':>5}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['k']:>2} {r['plain_tokens_per_s']:>11.0f} {r['tokens_per_s']:>10.0f} "
            f"{r['vs_plain']:>7.2f} {r['kept']:>5.0%}"
        )


if __name__ == "__main__":
    main()
