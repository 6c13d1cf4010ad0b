"""Training throughput of one pretrain step on one CPU device: tokens/s, ms/step, MFU, compile time.

Shape (nanoGPT's "baby GPT" scale): 6 layers, 6 heads, d_model 384, SwiGLU d_ff 1024 (the
parameter count of a 4x GELU MLP), seq_len 256, batch 16, byte vocabulary, tied embeddings,
RoPE. MFU is against the matmul peak measured in the same run (lm.train.perf.measure_matmul_peak).

    PYTHONPATH=. python bench/train_throughput.py [--steps 20] [--rounds 1] [--out figures.json] \
        [--peer-python /tmp/torch-venv/bin/python --nanogpt /tmp/nanoGPT]

With the peer flags, bench/nanogpt_peer.py runs right after our measurement of each dtype,
twice: as it ships (the environment this script was started with) and with the huge-page
malloc tunable that `lm` sets for itself (lm.process.hugepages), so the ratio ours/peer is printed
both for each as shipped and for the same process environment. With --rounds N the
measurement alternates N times and medians are reported. Prints figures only; asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

# One real CPU device: drop a simulated-device count inherited from the environment. A worker
# (--worker DTYPE, started by main for each dtype) then applies the CPU defaults that `lm train`
# applies for that compute dtype (lm.process.cpu_flags) before jax starts, so its figures are those of
# `lm train`; the flags differ by dtype, hence one process per dtype.
os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
if "--worker" in sys.argv:
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults(sys.argv[sys.argv.index("--worker") + 1])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config, validate  # noqa: E402
from lm.model import counts  # noqa: E402
from lm.plan.aot import compile_train_step  # noqa: E402
from lm.process.hugepages import with_hugepages  # noqa: E402
from lm.train.perf import measure_matmul_peak, mfu  # noqa: E402
from lm.train.setup import build_run, host_batch  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
SEQ, BATCH = 256, 16


def make_config(dtype: str, n_layers: int = 6):
    c = base_config()
    c.model.update(
        vocab_size=256,
        d_model=384,
        n_layers=n_layers,
        n_heads=6,
        n_kv_heads=6,
        d_ff=1024,
        mlp="swiglu",
        position="rope",
        max_seq_len=SEQ,
        tie_embeddings=True,
        compute_dtype=dtype,
    )
    c.data.seq_len, c.train.batch_size = SEQ, BATCH
    c.mesh.update(data=1, fsdp=1, tensor=1)
    validate(c)
    return c


def compile_seconds(dtype: str, n_layers: int) -> float:
    """Ahead-of-time compile of the full train step on abstract inputs (nothing is allocated)."""
    return compile_train_step("pretrain", make_config(dtype, n_layers), jax.devices()[:1])["compile_s"]


def measure_ours(dtype: str, steps: int, warmup: int, peak: float) -> dict:
    config = make_config(dtype)
    run = build_run(config, devices=jax.devices()[:1])
    state, step = run.init_state(0), run.train_step()
    batch = run.placer()(host_batch(run.signature(), vocab_size=256))
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):  # block every step: the figure is per-step latency, as for the peer
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    dt = float(np.mean(times))
    tps = BATCH * SEQ / dt
    flops = counts.flops_per_token(config.model, SEQ)
    return {
        "dtype": dtype,
        "tokens_per_s": tps,
        "ms_per_step": dt * 1e3,
        "ms_per_step_median": float(np.median(times)) * 1e3,
        "ms_per_step_min": min(times) * 1e3,
        "mfu": mfu(tps, flops, peak),
        "compile_s": compile_s,
        "flops_per_token": flops,
        "params": counts.param_count(config.model),
        "loss": float(metrics["loss"]),
    }


def measure_peer(args, dtype: str, env: dict) -> dict | None:
    script = REPO / "bench" / "nanogpt_peer.py"
    if not (args.peer_python and args.nanogpt):
        return None
    if not script.is_file():
        print(f"note: {script} not found; peer skipped")
        return None
    cmd = [
        args.peer_python,
        str(script),
        "--nanogpt",
        args.nanogpt,
        "--dtype",
        dtype,
        "--steps",
        str(args.peer_steps),
        "--warmup",
        str(args.warmup),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"note: peer failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows, headers) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def run_worker(args) -> dict:
    """Measures one dtype (or, for 'compile', the compile time by depth) in this process."""
    if args.worker == "compile":
        return {"compile_s_by_depth": {int(d): compile_seconds("float32", int(d)) for d in args.depths.split(",") if d}}
    peak = measure_matmul_peak(args.worker)
    return {
        "peak": peak,
        "ours": measure_ours(args.worker, args.steps, args.warmup, peak),
        "xla_flags": os.environ["XLA_FLAGS"],
        "device": str(jax.devices()[0]),
    }


def spawn_worker(args, what: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        what,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--depths",
        args.depths,
    ]
    # The environment `lm train` gives itself (lm.cli.run): huge-page malloc where it applies.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, env=with_hugepages())
    return json.loads(proc.stdout.strip().splitlines()[-1])


PEERS = (("peer", "ratio_tokens_per_s"), ("peer_hugepages", "ratio_tokens_per_s_same_env"))
LABELS = {"peer": "as shipped", "peer_hugepages": "huge-page malloc"}


def median_by_speed(results: list[dict], speed=lambda r: r["tokens_per_s"]) -> dict:
    """The result with the median speed (the slower middle one for an even count)."""
    return sorted(results, key=speed)[(len(results) - 1) // 2]


def measure_round(args, dtype: str, peer_envs: dict, index: int) -> dict:
    """Ours, then the peer as shipped and with huge-page malloc, back to back; prints as it goes."""
    tag = f"[{dtype}]" if args.rounds == 1 else f"[{dtype} round {index + 1}]"
    w = spawn_worker(args, dtype)
    ours = w["ours"]
    result = {"peak": w["peak"], "ours": ours, "xla_flags": w["xla_flags"]}
    print(f"{tag} XLA_FLAGS={w['xla_flags']!r}; matmul peak {w['peak'] / 1e9:.0f} GFLOP/s", flush=True)
    print(
        f"{tag} ours: {ours['tokens_per_s']:.0f} tok/s, {ours['ms_per_step']:.1f} ms/step, "
        f"MFU {ours['mfu']:.1%}, compile {ours['compile_s']:.1f}s",
        flush=True,
    )
    for key, ratio_key in PEERS:
        peer = measure_peer(args, dtype, peer_envs[key])
        if peer is not None:
            result[key] = peer
            ratio = result[ratio_key] = ours["tokens_per_s"] / peer["tokens_per_s"]
            print(
                f"{tag} nanoGPT ({LABELS[key]}): {peer['tokens_per_s']:.0f} tok/s, {peer['ms_per_step']:.1f} "
                f"ms/step; ours/peer {ratio:.2f}x",
                flush=True,
            )
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per dtype")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--depths", default="2,24", help="n_layers whose compile time is measured (float32)")
    p.add_argument("--peer-python", help="a Python with torch, e.g. /tmp/torch-venv/bin/python")
    p.add_argument("--nanogpt", help="a nanoGPT checkout, e.g. /tmp/nanoGPT")
    p.add_argument("--peer-steps", type=int, default=10, help="timed peer steps")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each dtype this many times, ours and the peer alternating; the median is reported",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one dtype, print JSON
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args), default=float))
        return 0
    if not (args.peer_python and args.nanogpt):
        print("note: no --peer-python/--nanogpt given; peer skipped")

    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, batch {BATCH} x seq {SEQ} = {BATCH * SEQ} "
        f"tokens/step, model.attention={make_config('float32').model.attention}, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    shape = dict(make_config("float32").model.to_dict(), seq_len=SEQ, batch_size=BATCH)
    out = {
        "load_average_start": os.getloadavg()[0],
        "shape": shape,
        "xla_flags": {},
        "peaks": {},
        "ours": {},
        "peer": {},
        "peer_hugepages": {},
        "ratio_tokens_per_s": {},
        "ratio_tokens_per_s_same_env": {},
        "compile_s_by_depth": {},
        "rounds": {},
    }
    # The peer as shipped (this script's environment) and in the environment our workers get.
    peer_envs = {"peer": dict(os.environ), "peer_hugepages": with_hugepages()}
    for dtype in args.dtypes.split(","):
        rounds = [measure_round(args, dtype, peer_envs, r) for r in range(args.rounds)]
        out["rounds"][dtype] = rounds
        middle = median_by_speed(rounds, lambda r: r["ours"]["tokens_per_s"])
        ours = out["ours"][dtype] = middle["ours"]
        out["peaks"][dtype], out["xla_flags"][dtype] = middle["peak"], middle["xla_flags"]
        for key, ratio_key in PEERS:
            if all(key in r for r in rounds):
                out[key][dtype] = median_by_speed([r[key] for r in rounds])
                out[ratio_key][dtype] = statistics.median(r[ratio_key] for r in rounds)
        if args.rounds > 1:
            print(
                f"[{dtype}] median of {args.rounds} rounds: ours {ours['ms_per_step']:.1f} ms/step; ours/peer "
                + ", ".join(f"{out[rk][dtype]:.2f}x ({LABELS[k]})" for k, rk in PEERS if dtype in out[rk]),
                flush=True,
            )
    if args.depths:
        out["compile_s_by_depth"] = spawn_worker(args, "compile")["compile_s_by_depth"]
        for depth, s in out["compile_s_by_depth"].items():
            print(f"compile (float32, {depth} layers): {s:.1f}s", flush=True)

    def cell(key, dtype, fmt):
        return fmt(out[key][dtype]) if dtype in out[key] else "-"

    rows = []
    for dtype, o in out["ours"].items():
        rows.append(
            [
                dtype,
                f"{out['peaks'][dtype] / 1e9:.0f}",
                f"{o['tokens_per_s']:.0f}",
                f"{o['ms_per_step']:.1f}",
                f"{o['mfu']:.1%}",
                f"{o['compile_s']:.1f}",
                cell("peer", dtype, lambda p: f"{p['ms_per_step']:.1f}"),
                cell("ratio_tokens_per_s", dtype, lambda r: f"{r:.2f}"),
                cell("peer_hugepages", dtype, lambda p: f"{p['ms_per_step']:.1f}"),
                cell("ratio_tokens_per_s_same_env", dtype, lambda r: f"{r:.2f}"),
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "dtype",
                "peak GF/s",
                "tok/s",
                "ms/step",
                "MFU",
                "compile s",
                "peer ms/step",
                "ours/peer",
                "peer ms/step (huge pages)",
                "ours/peer (same env)",
            ],
        )
    )
    print(
        "compile s by depth (float32): "
        + ", ".join(f"{d} layers {s:.1f}" for d, s in out["compile_s_by_depth"].items())
    )
    out["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end {out['load_average_end']:.1f} (this run alone accounts for ~2 on 2 cores)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2, default=float))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
