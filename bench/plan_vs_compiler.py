"""The planner (lm.plan.memory, no compile) against the TPU compiler (libtpu, ahead of time on this
CPU machine) for the pretraining step of each config and slice below: per-device total bytes and
the error. Needs the `tpu` extra. Prints one row per case as it compiles, then the table.

    JAX_PLATFORMS=cpu python bench/plan_vs_compiler.py [--only 70b] [--steps pretrain,dpo]

Settings: the config's own, except the micro-batch count (and for 8B the batch and mesh) chosen so
that every chip holds one or a few rows of each micro-batch, as a run on that slice would. The
mixture-of-experts (Mixtral-8x7B) and pipelined (Llama-3-70B over 4 stages) rows check the
planner's expert and pipeline terms (`--only moe`, `--only mixtral`, `--only pipelined`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lm.config import load_config  # noqa: E402
from lm.plan.aot import compile_step, target_devices  # noqa: E402
from lm.plan.hardware import parse_target  # noqa: E402
from lm.plan.memory import estimate, mesh_sizes  # noqa: E402
from lm.plan.report import mesh_text  # noqa: E402

# 8 experts (top-2) of width 512 over 2 layers of width 256, split over expert 2 x fsdp 2; one row of
# 4096 tokens a chip, so the activations live in HBM, not in the chip's on-chip memory
SMALL_MOE = [
    "model.vocab_size=4096",
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=512",
    "model.n_experts=8",
    "model.experts_per_token=2",
    "model.max_seq_len=4096",
    "model.tie_embeddings=False",
    "model.compute_dtype=bfloat16",
    "model.attention=xla",
    "model.remat=full",
    "data.seq_len=4096",
    "train.batch_size=4",
    "mesh.data=1",
    "mesh.fsdp=2",
    "mesh.expert=2",
]
CASES = [  # name, config, target, overrides
    ("tiny", "configs/tiny.py", "v5e-4", []),
    ("124M", "configs/gpt2_124m.py", "v5e-4", ["train.micro_batches=16"]),
    ("124M", "configs/gpt2_124m.py", "v5e-4", []),
    ("Llama-3-8B", "configs/llama3_8b.py", "v5p-8", ["train.batch_size=32", "train.micro_batches=8"]),
    (
        "Llama-3-8B",
        "configs/llama3_8b.py",
        "v5e-16",
        ["train.batch_size=32", "train.micro_batches=8", "mesh.fsdp=4", "mesh.tensor=4", "data.seq_len=4096"],
    ),
    ("Llama-3-70B", "configs/llama3_70b.py", "v5p-64", ["train.micro_batches=256"]),
    ("Llama-3-70B", "configs/llama3_70b.py", "v5p-128", ["train.micro_batches=128"]),
    ("Llama-3.1-405B", "configs/llama3_405b.py", "v5p-512", []),
    ("small MoE", "configs/tiny.py", "v5p-8", SMALL_MOE),
    ("Mixtral-8x7B", "configs/mixtral_8x7b.py", "v5p-64", []),
    ("Mixtral-8x7B", "configs/mixtral_8x7b.py", "v5p-128", []),
    ("Mixtral-8x7B", "configs/mixtral_8x7b.py", "v5p-64", ["model.capacity_factor=1.25"]),
    ("Llama-3-70B pipelined", "configs/llama3_70b_pipeline.py", "v5p-128", []),
    ("Llama-3-70B pipelined", "configs/llama3_70b_pipeline.py", "v5p-128", ["model.pipeline_repeats=2"]),
    ("Llama-3-70B pipelined", "configs/llama3_70b_pipeline.py", "v5p-128", ["model.pipeline_schedule=1f1b"]),
    (
        "Llama-3-70B pipelined",
        "configs/llama3_70b_pipeline.py",
        "v5p-128",
        ["model.pipeline_schedule=1f1b", "model.pipeline_repeats=2"],
    ),
]
GiB = 2**30
STATE = ("params", "optimizer", "frozen base", "reference", "code")  # arguments, not temporaries


def size(gib: float) -> str:
    return f"{gib:.2f}" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="cases whose name or target contains this")
    ap.add_argument("--steps", default="pretrain")
    args = ap.parse_args()
    rows = []
    for name, path, target_name, overrides in CASES:
        if args.only and args.only.lower() not in f"{name} {target_name}".lower():
            continue
        target = parse_target(target_name)
        config = load_config(path, overrides)
        devices = target_devices(target)
        for step in args.steps.split(","):
            est = estimate(config, step, target.chips, chip=target.chip)
            start = time.perf_counter()
            c = compile_step(step, config, devices)
            took = time.perf_counter() - start
            got, planned = c.total, est.total
            if c.error:  # a refusal names the temporaries alone: compare the planner's
                planned = est.total - sum(est.parts.get(k, 0) for k in STATE)
            err = (planned - got) / got if got else float("nan")
            fits = "refused" if c.error else ("yes" if got <= target.hbm_bytes else "no")
            row = (
                name,
                target_name,
                step,
                " ".join(overrides),
                planned / GiB,
                (got or 0) / GiB,
                err,
                target.hbm_bytes / GiB,
                fits,
                took,
                mesh_text(mesh_sizes(config, target.chips)),
            )
            rows.append(row)
            print(" | ".join(str(x) for x in row), flush=True)
            if c.error:
                print(f"  compiler: {c.error}", flush=True)
    print()
    print("(refused: the compiler names the temporaries alone, and both columns are temporaries)")
    print(
        "| model | slice | step | mesh | settings | planner GiB | compiler GiB | error | HBM GiB | fits | compile s |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|---|---:|")
    for name, target, step, ov, est, got, err, hbm, fits, took, mesh in rows:
        print(
            f"| {name} | {target} | {step} | {mesh} | {ov or '(config)'} | {size(est)} | {size(got)} | {err:+.1%} "
            f"| {hbm:.0f} | {fits} | {took:.0f} |"
        )
    worst = max((abs(r[6]) for r in rows), default=0.0)
    print(f"\nlargest error: {worst:.1%} (target: within 15%)")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
