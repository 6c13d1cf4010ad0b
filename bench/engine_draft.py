"""Draft-model speculation inside the engine (every row drafts k tokens with a small model over its
own paged pool, the target verifies them in one pass) against plain engine decoding: new tokens/s
at batch 1 and 8, drafts kept, and the target/draft cost ratio measured in the same run.

The fair case, with random weights (a random draft never agrees with a random target): a
"self-speculative" layer-skip draft. The target is a random-weight Llama of --layers layers
(vocabulary 2048, float32) whose layers after the first --draft-layers have their residual output
projections (attention `wo`, MLP `w_down`) scaled by --damp, so they change the residual stream
little; the draft is the same model's first --draft-layers layers with the same embedding and
head. The draft then agrees with the target most of the time, as a trained early-exit or distilled
draft would, while costing a fraction of it (the ratio is printed: plain decoding tokens/s of the
draft alone over the target's). Greedy, 64-token random prompts, --new-tokens each. Plain and
speculative runs alternate in rounds (the machine's speed drifts); medians are reported with the
median of the per-round ratios. Every speculative run is checked to return the plain run's tokens.

    PYTHONPATH=. python bench/engine_draft.py [--rounds 3] [--k 2 4] [--layers 16 --draft-layers 2]

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
import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config  # noqa: E402
from lm.infer.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402

VOCAB, PROMPT = 2048, 64


def models(d_model: int, layers: int, draft_layers: int, damp: float, max_len: int):
    """(target, its params, draft, its params): the draft is the target's first layers."""
    m = base_config().model
    m.update(
        vocab_size=VOCAB,
        d_model=d_model,
        n_layers=layers,
        n_heads=max(1, d_model // 64),
        n_kv_heads=max(1, d_model // 256),
        d_ff=d_model * 8 // 3 // 64 * 64,
        max_seq_len=max_len,
        init_std=0.1,
    )
    target = Transformer(ModelSpec.from_config(m))
    params = jax.jit(lambda k: nn.unbox(init_params(target, k)))(jax.random.PRNGKey(0))
    scale = np.where(np.arange(layers) < draft_layers, 1.0, damp).astype(np.float32)

    def damped(path, x):
        if path[-1].key in ("wo", "w_down"):
            return x * scale.reshape((-1,) + (1,) * (x.ndim - 1))
        return x

    params = jax.tree_util.tree_map_with_path(damped, params)
    draft = Transformer(dataclasses.replace(target.spec, n_layers=draft_layers))
    draft_params = params | {"blocks": jax.tree.map(lambda x: x[:draft_layers], params["blocks"])}
    return target, params, draft, draft_params


def prompts(batch: int) -> list[list[int]]:
    return np.random.default_rng(1).integers(3, VOCAB, (batch, PROMPT)).tolist()


def decode(model, params, batch: int, new: int, k: int = 0, draft=None):
    """(new tokens/s, the tokens, (drafts proposed, kept)) of one engine run."""
    engine = Engine(model, max_len=PROMPT + new, config=EngineConfig(slots=batch, speculate=k), draft=draft)
    reqs = [Request(p, SamplingParams(max_new_tokens=new, temperature=0), eos=(-1,)) for p in prompts(batch)]
    start = time.perf_counter()
    engine.run(params, reqs)
    return batch * new / (time.perf_counter() - start), [r.ids for r in reqs], engine.acceptance


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--damp", type=float, default=0.03, help="the scale of the later layers' output projections")
    args = p.parse_args()
    target, t_params, draft, d_params = models(
        args.d_model, args.layers, args.draft_layers, args.damp, PROMPT + args.new_tokens
    )
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree)) / 1e6  # noqa: E731
    print(
        f"target: {count(t_params):.1f}M params, {args.layers} layers; "
        f"draft: {count(d_params):.1f}M, {args.draft_layers} layers"
    )
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        new = args.new_tokens
        runs = {name: [] for name in ["plain", "draft alone", *args.k]}
        run = {
            "plain": lambda: decode(target, t_params, batch, new),
            "draft alone": lambda: decode(draft, d_params, batch, new),
        } | {k: (lambda k=k: decode(target, (t_params, d_params), batch, new, k, draft)) for k in args.k}
        want, kept = run["plain"]()[1], {}  # compile, and the tokens to match
        run["draft alone"]()
        for k in args.k:
            _, ids, kept[k] = run[k]()
            assert ids == want, f"k={k}: speculation changed the greedy tokens"
        for _ in range(args.rounds):
            for name in runs:
                runs[name].append(run[name]()[0])
        cost = statistics.median(d / t for d, t in zip(runs["draft alone"], runs["plain"]))
        for k in args.k:
            proposed, accepted = kept[k]
            row = dict(
                batch=batch,
                k=k,
                target_over_draft_cost=cost,
                plain_tokens_per_s=statistics.median(runs["plain"]),
                tokens_per_s=statistics.median(runs[k]),
                vs_plain=statistics.median(s / p for s, p in zip(runs[k], runs["plain"])),
                kept=accepted / max(proposed, 1),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'batch':>5} {'k':>2} {'cost x':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'x plain':>7} {'kept':>5}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['k']:>2} {r['target_over_draft_cost']:>6.1f} {r['plain_tokens_per_s']:>11.0f} "
            f"{r['tokens_per_s']:>10.0f} {r['vs_plain']:>7.2f} {r['kept']:>5.0%}"
        )


if __name__ == "__main__":
    main()
