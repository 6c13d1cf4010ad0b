"""Mixture of experts against the dense tiny model at equal active FLOPs per token: held-out loss and tokens/s.

Two pretraining runs (lm.train.pretrain.train, exactly as `lm train` runs them) on the default corpus,
the Python standard library of this interpreter, prepared as configs/tiny.py prepares it (curated,
the 2,048-piece sentencepiece BPE, token shards): the demo's data, reused from the data cache when a
demo or `lm train --config configs/tiny.py` built it, built the same way otherwise.

- dense: configs/tiny.py (4 layers, d_model 128, SwiGLU d_ff 384);
- MoE: the same with every block's MLP as `--experts` SwiGLU experts of width d_ff / `--k`, `--k` of
  them per token (model.n_experts, experts_per_token, expert_d_ff; dropless, the default): the
  active MLP width of a token is the dense one's (k * expert_d_ff == d_ff), so the matmul FLOPs
  per token are equal but for the router's d_model x experts; the MLP weights are `--experts / --k`
  times as many.

Same data order, steps, batch, learning-rate schedule and seeds. Both evaluate the held-out loss
(the config's eval section: eval.batches x eval.batch_size rows of the held-out split) every
`--eval-every` steps. Then the two compiled train steps are timed in interleaved rounds (dense,
MoE, dense, MoE, ... on one batch of random tokens) for a tokens/s ratio measured side by side.

Prints: the held-out loss of both at every eval and the final gap, tokens/s (each training run's
own, and the interleaved rounds' medians and ratio), total and active params and FLOPs per token,
and the MoE's routing at its last logged step (balance loss, router z-loss, dropped assignments,
per-layer expert load min/max as multiples of an even share, load entropy). Writes one PNG with
both runs' loss curves and a JSON of the figures.

    .venv/bin/python bench/moe_vs_dense.py [--steps 400] [--eval-every 25] [--experts 8] [--k 2] \\
        [--rounds 3] [--round-steps 3] [--workdir runs/moe-vs-dense-<time>]

At 400 steps the MoE pulls ahead from step ~150 (at 200 steps the two end level). That takes
about 14 minutes on 2 idle cores (an estimate; 28-32 minutes were measured on a shared machine),
most of it the MoE's: XLA:CPU has no grouped matmul, so the dropless step runs at ~0.25-0.3x
the dense step's tokens/s. Runs on one device with the XLA flags and huge-page malloc that `lm`
sets for itself. Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    p.add_argument("--steps", type=int, default=400, help="training steps of each run")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    p.add_argument("--experts", type=int, default=8, help="model.n_experts of the MoE")
    p.add_argument("--k", type=int, default=2, help="model.experts_per_token; expert_d_ff = d_ff / k")
    p.add_argument("--capacity-factor", type=float, default=0.0, help="model.capacity_factor (0: dropless)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds of (dense, MoE)")
    p.add_argument("--round-steps", type=int, default=3, help="timed steps per model per round")
    p.add_argument("--workdir", default="", help="where both runs go (default: runs/moe-vs-dense-<time>)")
    p.add_argument("--out", default="", help="the JSON of figures (default: WORKDIR/moe_vs_dense.json)")
    p.add_argument("--override", action="append", default=[], help="a dotted config override for both runs")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None

# One real CPU device (drop a simulated-device count inherited from the environment), the XLA
# flags `lm train` applies for float32, and huge-page malloc as the `lm` command gets it.
os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
if ARGS is not None:
    from lm.process.cpu_flags import apply_cpu_defaults
    from lm.process.hugepages import reexec_with_hugepages

    reexec_with_hugepages()
    apply_cpu_defaults("float32")

import jax  # noqa: E402

from lm.config import load_config  # noqa: E402
from lm.data.cache import data_cache_dir  # noqa: E402
from lm.data.prepare import prepare_pretrain_data  # noqa: E402
from lm.model import counts  # noqa: E402
from lm.train.metrics import moe_routing, plot_runs, read_metrics  # noqa: E402
from lm.train.pretrain import train  # noqa: E402
from lm.train.setup import build_run, host_batch  # noqa: E402


def make_configs(args):
    """(dense, MoE) configs: the same run but for the MoE keys."""
    common = [
        f"train.steps={args.steps}",
        f"eval.every_steps={args.eval_every}",
        f"checkpoint.every_steps={args.steps}",
        "train.sample_tokens=16",
        *args.override,
    ]
    dense = load_config(args.config, common)
    d_ff = dense.model.d_ff
    if d_ff % args.k:
        sys.exit(f"--k {args.k} must divide model.d_ff={d_ff} for equal active FLOPs")
    moe = load_config(
        args.config,
        [
            *common,
            f"model.n_experts={args.experts}",
            f"model.experts_per_token={args.k}",
            f"model.expert_d_ff={d_ff // args.k}",
            f"model.capacity_factor={args.capacity_factor}",
        ],
    )
    return dense, moe


def sizes(m, seq_len: int) -> dict:
    return {
        "params_total": counts.param_count(m),
        "params_active": counts.active_param_count(m),
        "flops_per_token": counts.flops_per_token(m, seq_len),
    }


class Timed:
    """One model's compiled train step on one device, its state and one batch of random tokens."""

    def __init__(self, name: str, config):
        self.name, self.times = name, []
        run = build_run(config, devices=jax.devices()[:1])
        signature = run.signature()
        self.state = run.init_state(config.train.seed)
        self.batch = run.placer(signature)(host_batch(signature, seed=0, vocab_size=config.model.vocab_size))
        self.tokens = config.train.batch_size * config.data.seq_len
        self.params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.state.params))
        self.step = run.train_step(signature)
        self.run_step()  # compiles: untimed

    def run_step(self):
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))

    def timed(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.run_step()
        dt = (time.perf_counter() - t0) / steps
        self.times.append(dt)
        return dt


def table(rows, headers) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def prepare(config) -> dict:
    """The token shards both runs read (from the data cache when they are there), timed."""
    d = config.data
    t0 = time.perf_counter()
    data = prepare_pretrain_data(
        d, data_cache_dir(d), vocab_size=config.model.vocab_size, progress=False, curate_cfg=config.curate
    )
    return {
        "shards": str(data.train[0].shards.path),
        "seconds": time.perf_counter() - t0,
        "train_tokens": data.stats["train_tokens"],
        "heldout_tokens": data.stats["heldout_tokens"],
        "unigram_baseline": data.stats["unigram_entropy_nats"],
    }


def main(args) -> int:
    dense_config, moe_config = make_configs(args)
    workdir = pathlib.Path(args.workdir or REPO / "runs" / f"moe-vs-dense-{time.strftime('%Y%m%d-%H%M%S')}")
    out_path = pathlib.Path(args.out or workdir / "moe_vs_dense.json")
    png = workdir / "moe_vs_dense.png"
    m, mm, seq = dense_config.model, moe_config.model, dense_config.data.seq_len
    load_start = os.getloadavg()[0]
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, device {jax.devices()[0]}, load average {load_start:.1f}",
        flush=True,
    )
    data = prepare(dense_config)
    print(
        f"data: {data['shards']} ({data['train_tokens']:,} train tokens, {data['heldout_tokens']:,} held-out; "
        f"ready in {data['seconds']:.1f} s: a few seconds when the data cache had it)",
        flush=True,
    )
    tokens_per_step = dense_config.train.batch_size * seq
    figures = {"dense": sizes(m, seq), "moe": sizes(mm, seq)}
    print(
        f"dense: {m.n_layers} layers, d_model {m.d_model}, SwiGLU d_ff {m.d_ff}; MoE: {mm.n_experts} experts of "
        f"width {mm.expert_d_ff}, top-{mm.experts_per_token}, "
        f"{'dropless' if not mm.capacity_factor else f'capacity factor {mm.capacity_factor}'}, balance coef "
        f"{mm.moe_balance_coef}, z coef {mm.moe_z_coef}; {args.steps} steps x {tokens_per_step:,} tokens, lr "
        f"{dense_config.optim.lr}, held-out loss every {args.eval_every} steps on "
        f"{dense_config.eval.batches * dense_config.eval.batch_size * seq:,} tokens",
        flush=True,
    )
    for name in ("dense", "moe"):
        f = figures[name]
        print(
            f"  {name:5} params {f['params_total']:,} total, {f['params_active']:,} active; "
            f"{f['flops_per_token'] / 1e6:.2f} MFLOPs per token (training)",
            flush=True,
        )

    runs = {}
    for name, config in (("dense", dense_config), ("moe", moe_config)):
        print(f"\n--- training {name} ---", flush=True)
        t0 = time.perf_counter()
        summary = train(config, workdir / name, show_progress=False)
        rows = read_metrics(workdir / name / "metrics.jsonl")
        runs[name] = {"summary": summary, "rows": rows, "wall_s": time.perf_counter() - t0}
        figures[name] |= {
            "final_eval_loss": summary["eval_loss"],
            "run_tokens_per_s": summary["run_tokens_per_s"],
            "compile_s": summary["compile_s"],
            "wall_s": runs[name]["wall_s"],
            "eval_loss": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
        }

    print("\n--- throughput: the two compiled steps in interleaved rounds ---", flush=True)
    timed = [Timed("dense", dense_config), Timed("moe", moe_config)]
    for r in range(args.rounds):
        line = [f"{t.name} {t.timed(args.round_steps) * 1e3:.0f} ms/step" for t in timed]
        print(f"[round {r + 1}] " + ", ".join(line), flush=True)
    ratios = [d / e for d, e in zip(timed[0].times, timed[1].times)]  # MoE tokens/s over dense's
    for t in timed:
        figures[t.name] |= {
            "ms_per_step_rounds": [x * 1e3 for x in t.times],
            "tokens_per_s": t.tokens / statistics.median(t.times),
            "params_counted": t.params,
        }

    dense, moe = figures["dense"], figures["moe"]
    figures["moe_routing"] = moe_routing(runs["moe"]["rows"])
    figures["gap"] = moe["final_eval_loss"] - dense["final_eval_loss"]
    figures["ratio_tokens_per_s"] = statistics.median(ratios)
    figures["ratio_run_tokens_per_s"] = moe["run_tokens_per_s"] / dense["run_tokens_per_s"]
    figures |= {
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "data": data,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0],
        "model": {"dense": m.to_dict(), "moe": mm.to_dict()},
        "png": str(png),
    }

    steps = sorted(dense["eval_loss"])
    print("\nheld-out loss (nats/token):")
    print(
        table(
            [
                [
                    s,
                    f"{dense['eval_loss'][s]:.4f}",
                    f"{moe['eval_loss'].get(s, float('nan')):.4f}",
                    f"{moe['eval_loss'].get(s, float('nan')) - dense['eval_loss'][s]:+.4f}",
                ]
                for s in steps
            ],
            ["step", "dense", "MoE", "MoE - dense"],
        )
    )
    rel = figures["gap"] / dense["final_eval_loss"]
    print(
        f"final held-out loss at step {args.steps}: dense {dense['final_eval_loss']:.4f}, MoE "
        f"{moe['final_eval_loss']:.4f}: MoE - dense {figures['gap']:+.4f} nats/token ({rel:+.2%}); unigram "
        f"baseline {data['unigram_baseline']:.3f}"
    )
    print(
        f"params: dense {dense['params_total']:,}; MoE {moe['params_total']:,} total "
        f"({moe['params_total'] / dense['params_total']:.2f}x), {moe['params_active']:,} active; counted in the "
        f"state: {dense['params_counted']:,} and {moe['params_counted']:,}"
    )
    print(
        f"training FLOPs per token: MoE / dense {moe['flops_per_token'] / dense['flops_per_token']:.4f} "
        "(the router's d_model x experts)"
    )
    print(
        f"tokens/s, interleaved rounds (median round): dense {dense['tokens_per_s']:,.0f}, MoE "
        f"{moe['tokens_per_s']:,.0f}; MoE / dense {figures['ratio_tokens_per_s']:.3f} (median of the per-round "
        "ratios " + ", ".join(f"{x:.3f}" for x in ratios) + ")"
    )
    print(
        f"tokens/s, the training runs one after the other: dense {dense['run_tokens_per_s']:,.0f}, MoE "
        f"{moe['run_tokens_per_s']:,.0f} ({figures['ratio_run_tokens_per_s']:.3f}x); wall time dense "
        f"{dense['wall_s']:.0f} s, MoE {moe['wall_s']:.0f} s"
    )
    g = figures["moe_routing"]
    print(
        f"MoE routing at step {g['step']}: balance loss {g['balance']:.4f} (1 = even), router z {g['router_z']:.3f}, "
        f"dropped {g['dropped']:.4f}; expert load (x an even share) min {g['load_min']:.3f}, max {g['load_max']:.3f}"
    )
    for i, v in g["per_layer"].items():
        print(f"  layer {i}: load min {v['min']:.3f}, max {v['max']:.3f}, entropy {v['entropy']:.4f} (1 = even)")

    plot_runs(
        {
            "dense": workdir / "dense" / "metrics.jsonl",
            f"MoE {mm.n_experts}x{mm.expert_d_ff} top-{mm.experts_per_token}": workdir / "moe" / "metrics.jsonl",
        },
        png,
        baseline=data["unigram_baseline"],
        title=f"dense vs MoE at equal active FLOPs per token (tiny model, {args.steps} steps)",
    )
    print(f"load average at the end {figures['load_average_end']:.1f} (this run alone accounts for ~2 on 2 cores)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(figures, indent=2, default=float))
    print(f"wrote {png} and {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
