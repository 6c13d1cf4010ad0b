"""Tokens/s and MFU of lm's bf16 train step at three model shapes, against a PyTorch peer in the same run.

Shapes (all lm's decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases):

- gpt2-124m: 12 layers, d_model 768, 12 heads, vocab 50257, T 1024, tied head; SwiGLU d_ff 2048
  (3·768·2048 = the params of GPT-2's 4x GELU MLP), so 124M params;
- llama-1b: Llama-3.2-1B, 16 layers, d_model 2048, 32 heads over 8 kv heads, d_ff 8192, vocab
  128256, T 4096, tied head;
- llama-8b-layers: Llama-3-8B's layer (d_model 4096, 32 heads over 8 kv heads, d_ff 14336), vocab
  128256, T 8192, untied head, with `--layers` layers. The default is the most layers for which
  lm's fit search (lm.plan.fit.search, what `lm plan --fit` runs; the planner's estimate, no
  compile) finds a setting within its margin of the device's memory (jax's bytes_limit, else the
  chip's HBM), found by bisection over 1-128 layers.

A step is 32 x 1024, 8 x 4096 and 1 x 8192 tokens (the last as torchtitan runs Llama-3-8B per GPU;
`--tokens N` makes every batch N / T rows). Remat policy and micro-batch count are the ones
lm.plan.fit.search picks for that batch on one device; the peer (bench/mfu_torch.py: torch.compile,
flash SDPA, fused AdamW, bf16 autocast) uses the same ones. For an H200 (95% of its memory given to
jax) the planner's estimate allows 20 layers (5.4B params, remat full) in llama-8b-layers (`--layers`
sets it). lm's attention is its default, model.attention=auto: Pallas's fused flash attention on a
GPU, splash on a TPU, blockwise on CPU (`--attention` sets another).

FLOPs per token count attention causally: lm.model.counts.flops_per_token counts QK^T and AV over
the whole sequence (12·L·heads·head_dim·T, PaLM's convention); here half of that term is taken off,
since a causal kernel computes only the lower triangle (6·L·heads·head_dim·T). Matmul params count
6 FLOPs each per token, the head included even when tied. The JSON has both figures.

MFU is against two peaks: the chip's vendor dense bf16 figure (lm.plan.hardware: H100/H200 989,
A100 312, TPU v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s; an unknown chip has none) and the best
bf16 matmul peak measured in this run (lm.train.perf.measure_matmul_peak, in every lm worker).

Every measurement runs in its own process (the device's memory is free for each side), lm and
the peer alternating per shape, `--rounds` times; the medians of each side's rounds and the
median of the per-round ratios are reported. On CPU (or with `--small`) the shapes shrink to 2
layers, d_model 128, T 128-256, and no targets are printed (`--peer-eager` there skips the peer's
minute of torch.compile per shape, for smoke runs). Asserts nothing.

    python bench/mfu.py [--rounds 3] [--steps 10] [--layers N] [--tokens N] [--json figures.json]
        [--peer-python PY] [--peer-eager] [--small] [--shapes gpt2-124m,llama-1b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
if "--worker" in sys.argv:  # lm's CPU flags for bf16, before jax starts (as `lm train` does)
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("bfloat16")

from lm.config import base_config, validate  # noqa: E402
from lm.model import counts  # noqa: E402
from lm.plan.hardware import quiet_absent_tpu  # noqa: E402

quiet_absent_tpu(os.environ)  # libtpu installed but no TPU: no start-up warnings in the workers

# name: (layers, d_model, heads, kv_heads, d_ff, vocab, seq, tied, rows per step)
SHAPES = {
    "gpt2-124m": (12, 768, 12, 12, 2048, 50257, 1024, True, 32),
    "llama-1b": (16, 2048, 32, 8, 8192, 128256, 4096, True, 8),
    "llama-8b-layers": (0, 4096, 32, 8, 14336, 128256, 8192, False, 1),  # 0 layers: --layers or as many as fit
}
SMALL = {
    "gpt2-124m": (2, 128, 4, 4, 384, 512, 128, True, 4),
    "llama-1b": (2, 128, 4, 1, 512, 1024, 256, True, 2),
    "llama-8b-layers": (2, 128, 4, 1, 448, 1024, 256, False, 2),
}
TARGET_CHIPS = ("H100", "H200")  # where the targets below are set
TARGET_MFU = {"llama-1b": 0.5, "llama-8b-layers": 0.5}  # against the vendor peak
TARGET_RATIO = 1.0  # lm / peer, every shape
PEER_REMAT = {"none": "none", "full": "full", "dots_saveable": "dots", "dots_with_no_batch_dims_saveable": "dots"}


@dataclasses.dataclass
class Shape:
    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    tied: bool
    batch: int
    remat: str = "none"
    micro_batches: int = 1


def attention_for(platform: str) -> str:
    """lm's default, model.attention=auto: splash on a TPU, Pallas flash on a GPU, blockwise on CPU."""
    return "auto"


def make_config(s: Shape, attention: str = "auto"):
    c = base_config()
    c.model.update(  # lm's decoder: RMSNorm, RoPE, GQA, SwiGLU, no biases
        vocab_size=s.vocab,
        d_model=s.d_model,
        n_layers=s.layers,
        n_heads=s.heads,
        n_kv_heads=s.kv_heads,
        d_ff=s.d_ff,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        max_seq_len=s.seq,
        tie_embeddings=s.tied,
        compute_dtype="bfloat16",
        attention=attention,
        remat=s.remat,
    )
    c.data.seq_len = s.seq
    c.train.update(batch_size=s.batch, micro_batches=s.micro_batches)
    c.mesh.update(data=1, fsdp=1, tensor=1)
    validate(c)
    return c


def flops_per_token(s: Shape) -> tuple[float, float]:
    """(causal, as lm.model.counts counts it): training FLOPs per token."""
    full = counts.flops_per_token(make_config(s).model, s.seq)
    return full - 6 * s.layers * s.heads * (s.d_model // s.heads) * s.seq, full


# ---- workers (one process each) ---------------------------------------------------------------


def fit(s: Shape, attention: str, target) -> Shape | None:
    """`s` with the remat policy and micro-batches of lm's fit search, or None if nothing fits."""
    from lm.plan.fit import search

    found = search(make_config(s, attention), "pretrain", target, None)[0]
    if found is None:
        return None
    return dataclasses.replace(s, remat=found.model.remat, micro_batches=found.train.micro_batches)


def plan_worker(args) -> dict:
    """The device, and each shape's batch, layers, remat and micro-batches."""
    import jax

    from lm.plan.hardware import Chip, Target, chip_of_kind

    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    small = args.small or not accelerator
    attention = args.attention or attention_for(device.platform)
    chip = chip_of_kind(device.device_kind)
    memory = ((device.memory_stats() or {}) if accelerator else {}).get("bytes_limit")
    memory = memory or (chip.hbm_bytes if chip else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    target = Target(device.platform, device.device_kind, 1, Chip(device.device_kind, int(memory), 0.0, 0.0))
    shapes = []
    for name in args.shapes.split(","):
        s = Shape(name, *(SMALL if small else SHAPES)[name])
        s.batch = max(1, args.tokens // s.seq) if args.tokens else s.batch
        if name == "llama-8b-layers" and args.layers:
            s.layers = args.layers
        elif not s.layers:  # the most layers that fit: bisection over what the fit search accepts
            lo, hi = 0, 128
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fit(dataclasses.replace(s, layers=mid), attention, target) else (lo, mid - 1)
            s.layers = max(lo, 1)
        shapes.append(dataclasses.asdict(fit(s, attention, target) or s))
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "chip": chip.name if chip else None,
        "vendor_peak": chip.bf16_flops if chip else None,
        "memory_bytes": int(memory),
        "small": small,
        "attention": attention,
        "jax": jax.__version__,
        "shapes": shapes,
    }


def lm_worker(args) -> dict:
    """One shape's train step as `lm train` builds it: the matmul peak, compile, tokens/s over --steps."""
    import jax

    from lm.train.perf import measure_matmul_peak
    from lm.train.setup import build_run, host_batch

    s = Shape(**json.loads(args.shape))
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    peak = measure_matmul_peak("bfloat16", n=8192 if accelerator else 1024, min_seconds=1.0 if accelerator else 0.2)
    config = make_config(s, args.attention)
    run = build_run(config, devices=[device])
    state, step = run.init_state(0), run.train_step()
    batch = run.placer()(host_batch(run.signature(), vocab_size=s.vocab))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    for _ in range(max(args.warmup, 1)):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):  # dispatched back to back, one sync at the end (as the peer)
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    dt = (time.perf_counter() - t0) / args.steps
    out = {
        "tokens_per_s": s.batch * s.seq / dt,
        "ms_per_step": dt * 1e3,
        "compile_s": compile_s,
        "matmul_peak": peak,
        "params": counts.param_count(config.model),
        "loss": float(metrics["loss"]),
    }
    if accelerator and (stats := device.memory_stats()):
        out["peak_memory_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    return out


# ---- the driver --------------------------------------------------------------------------------


def run_worker(cmd: list, env: dict | None = None) -> dict | None:
    """The last stdout line of `cmd` as JSON (stderr passes through), or None if it failed."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"note: {pathlib.Path(cmd[1]).name} {' '.join(cmd[2:4])} failed (exit {proc.returncode})", flush=True)
        return None
    return json.loads(lines[-1])


def peer_available(python: str) -> str:
    """'' if `python` can run the peer, else why not."""
    if not python:
        return "no --peer-python"
    proc = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    return "" if proc.returncode == 0 else f"{python} has no torch"


def peer_shape(s: dict) -> str:
    keys = ("vocab", "d_model", "layers", "heads", "kv_heads", "d_ff", "seq", "batch", "micro_batches")
    return json.dumps({k: s[k] for k in keys} | {"tie": s["tied"], "remat": PEER_REMAT.get(s["remat"], "full")})


def ratio_of(a, b):
    return a / b if a and b else None


def summarise(plan: dict, s: dict, lm_runs: list, peer_runs: list, measured: float) -> dict:
    """One shape's row: medians over rounds, MFU against both peaks, the median per-round ratio."""
    causal, full = flops_per_token(Shape(**s))
    out = {"shape": s, "flops_per_token": causal, "flops_per_token_noncausal": full}
    out["params"] = counts.param_count(make_config(Shape(**s)).model)
    for side, runs in (("lm", lm_runs), ("peer", peer_runs)):
        ok = [r["tokens_per_s"] for r in runs if r]
        tps = statistics.median(ok) if ok else None
        flops = tps and tps * causal
        out[side] = {
            "tokens_per_s": tps,
            "mfu_vendor": ratio_of(flops, plan["vendor_peak"]),
            "mfu_measured": ratio_of(flops, measured),
            "rounds": runs,
        }
    per_round = [ratio_of(a and a["tokens_per_s"], b and b["tokens_per_s"]) for a, b in zip(lm_runs, peer_runs)]
    out["ratio_rounds"] = [r for r in per_round if r]
    out["ratio"] = statistics.median(out["ratio_rounds"]) if out["ratio_rounds"] else None
    if plan["chip"] in TARGET_CHIPS and not plan["small"]:
        want_mfu = TARGET_MFU.get(s["name"], 0.0)
        met = (out["lm"]["mfu_vendor"] or 0) >= want_mfu and (out["ratio"] or 0) >= TARGET_RATIO
        want = (f"MFU >= {want_mfu:.0%}, " if want_mfu else "") + f">= {TARGET_RATIO}x peer"
        out["target"] = f"{want}: {'met' if met else 'below'}"
    return out


def fmt(x, kind: str) -> str:
    if x is None:
        return "-"
    return {"pct": f"{x:.1%}", "tps": f"{x:,.0f}", "x": f"{x:.2f}x", "params": f"{x / 1e6:,.1f}M"}[kind]


# (header, side, key, format) of the table's figure columns
COLUMNS = [
    (f"{side} {name}", side, key, kind)
    for side in ("lm", "peer")
    for name, key, kind in (
        ("tok/s", "tokens_per_s", "tps"),
        ("MFU vendor", "mfu_vendor", "pct"),
        ("MFU measured", "mfu_measured", "pct"),
    )
]


def table(rows: list) -> str:
    targets = any("target" in r for r in rows)
    cells = [["shape", "params", *(c[0] for c in COLUMNS), "lm/peer"] + (["target"] if targets else [])]
    for r in rows:
        figures = [fmt(r[side][key], kind) for _, side, key, kind in COLUMNS]
        cells.append([r["shape"]["name"], fmt(r["params"], "params"), *figures, fmt(r["ratio"], "x")])
        cells[-1] += [r.get("target", "")] if targets else []
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def measure_rounds(args, plan: dict, env: dict) -> tuple[dict, dict]:
    """{shape: [lm result per round]}, {shape: [peer result per round]}: lm then the peer, shape by shape."""
    me = [sys.executable, str(pathlib.Path(__file__).resolve())]
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    why = peer_available(args.peer_python)
    if why:
        print(f"note: peer skipped ({why})")
    lm_runs, peer_runs = ({s["name"]: [] for s in plan["shapes"]} for _ in range(2))
    for r in range(args.rounds):
        for s in plan["shapes"]:
            cmd = me + ["--worker", "lm", "--shape", json.dumps(s), "--attention", plan["attention"]]
            ours = run_worker(cmd + common, env)
            peer = None
            if not why:
                cmd = [args.peer_python, str(REPO / "bench" / "mfu_torch.py"), "--shape", peer_shape(s)]
                peer = run_worker(cmd + common + (["--eager"] if args.peer_eager else []))
            lm_runs[s["name"]].append(ours)
            peer_runs[s["name"]].append(peer)
            print(
                f"round {r + 1} {s['name']} ({s['layers']} layers, {s['batch']}x{s['seq']} tokens, remat "
                f"{s['remat']}, {s['micro_batches']} micro-batch(es)): lm {fmt(ours and ours['tokens_per_s'], 'tps')}"
                f" tok/s, peer {fmt(peer and peer['tokens_per_s'], 'tps')} tok/s",
                flush=True,
            )
    return lm_runs, peer_runs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps({"plan": plan_worker, "lm": lm_worker}[args.worker](args)), flush=True)
        return 0
    # lm's workers may take 95% of an accelerator's memory (jax's default is 75%); each exits before the peer runs
    env = dict(os.environ) | {"XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")}
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--worker",
        "plan",
        "--shapes",
        args.shapes,
        "--tokens",
        str(args.tokens),
        "--layers",
        str(args.layers),
        "--attention",
        args.attention,
    ]
    plan = run_worker(cmd + (["--small"] if args.small else []), env)
    if plan is None:
        return 1
    if plan["platform"] == "cpu":  # the environment `lm train` gives itself
        from lm.process.hugepages import with_hugepages

        env = with_hugepages(env)
    vendor = f"{plan['vendor_peak'] / 1e12:.0f} TFLOP/s" if plan["vendor_peak"] else "none known"
    print(
        f"{plan['device']} ({plan['platform']}, jax {plan['jax']}): memory {plan['memory_bytes'] / 2**30:.1f} GiB, "
        f"vendor bf16 peak {vendor}, lm attention {plan['attention']}",
        flush=True,
    )
    lm_runs, peer_runs = measure_rounds(args, plan, env)
    peaks = [r["matmul_peak"] for runs in lm_runs.values() for r in runs if r]
    measured = max(peaks, default=0.0)
    rows = [summarise(plan, s, lm_runs[s["name"]], peer_runs[s["name"]], measured) for s in plan["shapes"]]
    print(
        f"\nmeasured bf16 matmul peak {measured / 1e12:.3f} TFLOP/s (best of {len(peaks)}); FLOPs per token with "
        f"causal attention; medians of {args.rounds} round(s), lm/peer the median of per-round ratios"
    )
    print(table(rows))
    out = {"plan": plan, "measured_peak": measured, "rounds": args.rounds, "steps": args.steps, "shapes": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["lm"]["tokens_per_s"] for r in rows) else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, default=0, help="llama-8b-layers' depth (0: as many as fit)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per step, batch = tokens / T (0: each shape's own)")
    p.add_argument("--small", action="store_true", help="the small shapes (always on CPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per round (the first compiles)")
    p.add_argument("--attention", default="", help="lm's model.attention (default: cudnn on GPU, else blockwise)")
    p.add_argument("--peer-python", default=sys.executable, help="a Python with torch ('' for no peer)")
    p.add_argument("--peer-eager", action="store_true", help="the peer without torch.compile (smoke runs only)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", choices=("plan", "lm"), help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := set(args.shapes.split(",")) - set(SHAPES):
        p.error(f"unknown shape(s): {', '.join(sorted(unknown))}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    return args


if __name__ == "__main__":
    sys.exit(main())
