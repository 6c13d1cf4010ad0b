"""Learning-rate sensitivity with and without QK-norm and z-loss, and float32 against bfloat16
master weights: the small-scale proxies of large runs' instabilities (Wortsman et al., 2023).

Short pretraining runs (lm.train.pretrain.train, exactly as `lm train` runs them) of a small
model on the demo's data (configs/tiny.py's corpus and tokenizer, reused from the data cache),
one per (variant, learning rate): variants plain, qk_norm (model.qk_norm), z_loss (optim.z_loss
1e-4) and both, learning rates from --lrs. Same data order, steps and seeds everywhere. Prints the
final held-out loss of every run, each variant's learning-rate sensitivity (the mean over the
rates of its loss above the best loss any run reached, a diverged run counted at the unigram
baseline), and at --lr-master the held-out loss with train.param_dtype float32 and bfloat16.
Writes a PNG (held-out loss against learning rate per variant) and a JSON of the figures.

    .venv/bin/python bench/stability.py [--steps 150] [--lrs 1e-3,3e-3,1e-2,3e-2,1e-1] \\
        [--workdir runs/stability-<time>]

Runs on one CPU device with the XLA flags `lm` sets for itself. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS = {
    "plain": [],
    "qk_norm": ["model.qk_norm=true"],
    "z_loss": ["optim.z_loss=1e-4"],
    "both": ["model.qk_norm=true", "optim.z_loss=1e-4"],
}
# a smaller model than the demo's so that a sweep of ~20 runs fits minutes on two cores
SHAPE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=192"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1", help="comma-separated peak learning rates")
    p.add_argument("--lr-master", type=float, default=3e-3, help="the rate of the float32 vs bfloat16 runs")
    p.add_argument("--workdir", default="", help="default: runs/stability-<time>")
    p.add_argument("--override", action="append", default=[], help="a dotted config override for every run")
    args = p.parse_args(argv)
    try:
        args.lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lrs {args.lrs!r}: expected comma-separated numbers")
    if not args.lrs or min(args.lrs) <= 0 or args.steps < 1:
        p.error("--lrs must be positive numbers and --steps >= 1")
    return args


ARGS = parse_args() if __name__ == "__main__" else None

if ARGS is not None:  # one real CPU device and the XLA flags `lm` sets; an import (a test) changes nothing
    os.environ["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    ).strip()
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("float32")

from lm.config import load_config  # noqa: E402
from lm.train.pretrain import train  # noqa: E402


def sensitivity(losses: list[float], best: float, ceiling: float) -> float:
    """Mean over the rates of (loss - best), a non-finite or above-ceiling loss counted at ceiling."""
    clipped = [min(x, ceiling) if math.isfinite(x) else ceiling for x in losses]
    return sum(x - best for x in clipped) / len(clipped)


def one(args, workdir: pathlib.Path, name: str, extra: list[str]) -> dict:
    overrides = [
        f"train.steps={args.steps}",
        f"eval.every_steps={args.steps}",
        f"checkpoint.every_steps={args.steps}",
        "train.sample_tokens=0",
        "optim.warmup_steps=15",
        *SHAPE,
        *args.override,
        *extra,
    ]
    t0 = time.perf_counter()
    summary = train(load_config(args.config, overrides), workdir / name, show_progress=False)
    row = {"eval_loss": float(summary["eval_loss"]), "unigram": float(summary["unigram_baseline"])}
    print(f"  {name:28} held-out loss {row['eval_loss']:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return row


def main(args) -> int:
    workdir = pathlib.Path(args.workdir or REPO / "runs" / f"stability-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"{args.steps} steps per run, {len(VARIANTS)} variants x {len(args.lrs)} rates; shape {' '.join(SHAPE)}")
    runs = {v: {} for v in VARIANTS}
    for lr in args.lrs:  # rate by rate, so that a cut-short sweep still compares the variants
        for variant, extra in VARIANTS.items():
            runs[variant][lr] = one(args, workdir, f"{variant}-lr{lr:g}", [f"optim.lr={lr}", *extra])
    unigram = next(iter(runs["plain"].values()))["unigram"]
    best = min(r["eval_loss"] for v in runs.values() for r in v.values() if math.isfinite(r["eval_loss"]))
    print("\nheld-out loss (nats/token) by peak learning rate; unigram baseline", f"{unigram:.3f}")
    print(f"{'variant':10}" + "".join(f"{lr:>10g}" for lr in args.lrs) + f"{'sensitivity':>13}")
    figures = {"steps": args.steps, "lrs": args.lrs, "unigram": unigram, "best": best, "variants": {}}
    for variant, by_lr in runs.items():
        losses = [by_lr[lr]["eval_loss"] for lr in args.lrs]
        s = sensitivity(losses, best, unigram)
        figures["variants"][variant] = {"eval_loss": losses, "sensitivity": s}
        print(f"{variant:10}" + "".join(f"{x:10.4f}" for x in losses) + f"{s:13.4f}")
    print(f"\nmaster weights at lr {args.lr_master:g}:")
    master = {
        d: one(args, workdir, f"{d}-params", [f"optim.lr={args.lr_master}", f"train.param_dtype={d}"])["eval_loss"]
        for d in ("float32", "bfloat16")
    }
    figures["master_weights"] = master
    print(f"bfloat16 - float32 params: {master['bfloat16'] - master['float32']:+.4f} nats/token")
    plot(figures, workdir / "stability.png")
    (workdir / "stability.json").write_text(json.dumps(figures, indent=1))
    print(f"wrote {workdir / 'stability.png'} and {workdir / 'stability.json'}")
    return 0


def plot(figures: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, f in figures["variants"].items():
        ax.plot(figures["lrs"], [min(x, figures["unigram"]) for x in f["eval_loss"]], marker="o", label=variant)
    ax.axhline(figures["unigram"], color="grey", linestyle=":", label="unigram baseline")
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="held-out loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(ARGS))
