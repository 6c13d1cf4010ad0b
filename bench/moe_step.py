"""Train-step speed of a mixture of experts against the dense model of the same active FLOPs.

Three models share everything but the feed-forward: dense SwiGLU of width F; E experts of width
F/k with k per token, dropless (grouped matmuls, `jax.lax.ragged_dot`); the same experts with
capacity factor 1.25 (GShard dispatch einsums). Each token runs the same MLP FLOPs in all three,
so the ratio to dense is the price of routing. Steps of the three alternate in rounds on one
device; medians are printed, with tokens/s and the MoE's total vs active params. Asserts nothing.

    PYTHONPATH=. python bench/moe_step.py [--d-model 256 --layers 4 --experts 8 --k 2]
        [--seq 256 --batch 8 --dtype float32 --rounds 5 --steps 5] [--out figures.json]
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

import jax  # noqa: E402

from lm.config import base_config, validate  # noqa: E402
from lm.model import counts  # noqa: E402
from lm.train.setup import build_run, host_batch  # noqa: E402


def make_config(a, kind: str):
    c = base_config()
    f = 4 * a.d_model
    c.model.update(
        vocab_size=a.vocab,
        d_model=a.d_model,
        n_layers=a.layers,
        n_heads=a.d_model // 64,
        n_kv_heads=a.d_model // 64,
        d_ff=f,
        max_seq_len=a.seq,
        compute_dtype=a.dtype,
        attention="xla" if jax.default_backend() != "cpu" else "blockwise",
    )
    if kind != "dense":
        c.model.update(
            n_experts=a.experts,
            experts_per_token=a.k,
            expert_d_ff=f // a.k,
            capacity_factor=1.25 if kind == "capacity" else 0.0,
        )
    c.data.seq_len, c.train.batch_size = a.seq, a.batch
    c.mesh.update(data=1)
    validate(c)
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()
    kinds, runs, times = ("dense", "dropless", "capacity"), {}, {}
    for kind in kinds:
        c = make_config(a, kind)
        run = build_run(c, devices=jax.devices()[:1])
        state, step = run.init_state(0), run.train_step()
        batch = run.placer()(host_batch(run.signature(), vocab_size=a.vocab))
        t0 = time.perf_counter()
        step = step.lower(state, batch).compile()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        runs[kind] = [step, state, batch, c, time.perf_counter() - t0]
        times[kind] = []
    for _ in range(a.rounds):
        for kind in kinds:
            step, state, batch = runs[kind][:3]
            t0 = time.perf_counter()
            for _ in range(a.steps):
                state, m = step(state, batch)
            jax.block_until_ready(m)
            times[kind].append((time.perf_counter() - t0) / a.steps)
            runs[kind][1] = state
    tokens = a.seq * a.batch
    out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "args": vars(a)}
    for kind in kinds:
        c = runs[kind][3]
        sec = statistics.median(times[kind])
        out[kind] = {
            "step_ms": 1e3 * sec,
            "tokens_per_s": tokens / sec,
            "compile_s": runs[kind][4],
            "params": counts.param_count(c.model),
            "active_params": counts.active_param_count(c.model),
            "per_round_ratio_to_dense": [d / t for d, t in zip(times["dense"], times[kind])],
        }
    for kind in kinds:
        o = out[kind]
        print(
            f"{kind:9s} {o['step_ms']:8.1f} ms/step {o['tokens_per_s']:10.0f} tok/s  "
            f"x{o['tokens_per_s'] / out['dense']['tokens_per_s']:.2f} of dense  params {o['params']:,}"
            f" active {o['active_params']}  compile {o['compile_s']:.1f}s"
        )
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
