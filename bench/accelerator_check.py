"""The Python half of bench/accelerator_check.sh: fused attention (cuDNN on GPU) against lm's reference
attention on packed documents, train-step MFU against the chip's vendor peak, and the one table.

    python bench/accelerator_check.py probe          # prints jax's platform; exit 3 without an accelerator
    python bench/accelerator_check.py attention --rows ROWS [--quick]
    python bench/accelerator_check.py throughput --rows ROWS [--quick]
    python bench/accelerator_check.py decode --rows ROWS --figures DECODE_JSON
    python bench/accelerator_check.py record --rows ROWS --check NAME (--rc N | --skip) [--figure F] [--target T]
    python bench/accelerator_check.py table --rows ROWS      # prints the table; exit 1 if a row failed

ROWS is a JSON-lines file of rows {check, result (pass, FAIL or skip), figure, target}.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import base_config
from lm.model.apply import target_logprobs
from lm.model.attention import attend, reference_attention, segment_causal_mask
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer, init_params
from lm.plan.hardware import chip_of_kind
from lm.train.perf import measure_matmul_peak

IMPLEMENTATIONS = ("splash", "flash", "cudnn", "xla", "blockwise")  # splash: TPU; flash: GPU
DTYPES = ("bfloat16", "float32")
# Errors are relative to the reference's size. bfloat16 keeps 8 bits (0.4% per rounding) and a fused kernel
# also rounds the probabilities; float32 leaves room for TF32 matmuls, JAX's default on GPU (TPUs default to
# bf16 passes: `tolerance`). A mask that lets documents see each other gives errors of 0.1 to 1.
TOLERANCE = {"bfloat16": 3e-2, "float32": 5e-3}
# Outputs of other documents must not move when one document changes: exactly 0 with a correct mask.
LEAK_TOLERANCE = 1e-3


# ---- packed batches ---------------------------------------------------------------------------


def packed_segments(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """[B, T] int32 segment ids: 3 to 5 documents per row at random cuts, the last row ending in padding (0)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, length), np.int32)
    for row in range(batch):
        used = length - (length // 8 if row == batch - 1 else 0)
        cuts = np.sort(rng.choice(np.arange(1, used), size=2 + row % 3, replace=False))
        seg[row, :used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
    return seg


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Each token's position inside its document (RoPE restarts per document)."""
    index = np.broadcast_to(np.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = np.concatenate([np.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


def _max_error(got, want, where) -> float:
    """max |got - want| over max |want|, both where `where` holds."""
    diff = jnp.where(where, jnp.abs(_f32(got) - _f32(want)), 0.0)
    return float(jnp.max(diff) / jnp.max(jnp.where(where, jnp.abs(_f32(want)), 0.0)))


def _leak(moved, changed, others) -> float:
    """How far outputs moved in other documents over how far they moved in the changed one."""
    return float(jnp.max(jnp.where(others, moved, 0.0)) / jnp.max(jnp.where(changed, moved, 0.0)))


# ---- attention ----------------------------------------------------------------------------------


def attention_errors(
    candidate, segment_ids, dtype: str = "bfloat16", heads=(4, 2), head_dim: int = 64, seed: int = 0
) -> dict:
    """Errors of `candidate(q, k, v, segment_ids)` against lm's reference attention computed in float32
    (highest precision) from the same inputs: the output and the gradients of q, k, v at real (non-padding)
    positions, each as `_max_error`; `leak`: how far other documents' outputs move when document 1's
    keys and values change (`_leak`)."""
    seg = jnp.asarray(segment_ids)
    b, t = seg.shape
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, heads[0], head_dim)).astype(dtype)
    k, v = (jax.random.normal(key, (b, t, heads[1], head_dim)).astype(dtype) for key in keys[1:3])
    real, doc1 = (seg > 0)[:, :, None, None], (seg == 1)[:, :, None, None]
    cotangent = jax.random.normal(keys[3], q.shape) * real  # padding outputs feed no loss
    noise = (jax.random.normal(keys[4], k.shape) * doc1).astype(dtype)  # document 1's keys and values, changed
    mask = segment_causal_mask(seg)

    def run(fn):  # one program per path: the output, grads of q, k, v, and the output with the noise
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(_f32(out) * cotangent), out

        def outputs(q, k, v):
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return out, *grads, fn(q, k + noise, v + noise)

        return jax.jit(outputs)(q, k, v)

    with jax.default_matmul_precision("highest"):
        want = run(lambda q, k, v: reference_attention(_f32(q), _f32(k), _f32(v), mask))
    got = run(lambda q, k, v: candidate(q, k, v, seg))
    errors = {name: _max_error(g, w, real) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    errors["leak"] = _leak(jnp.abs(_f32(got[4]) - _f32(got[0])), doc1, real & ~doc1)
    return errors


def model_errors(attention: str, dtype: str, segment_ids, seed: int = 0) -> dict:
    """A 2-layer Transformer (GQA, head_dim 64) with model.attention=`attention` against attention=reference,
    same params and compute dtype, on a packed batch: logits and param gradients (mean next-token loss over
    real positions) as ||got - want|| / ||want||; `leak`: how far other documents' logits move when document
    1's tokens change (`_leak`)."""
    b, t = segment_ids.shape
    # init_std 1/sqrt(d_model), not 0.02: attention must matter in the logits, or a leak would hide in them
    m = base_config().model
    m.update(
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        d_ff=512,
        n_layers=2,
        max_seq_len=t,
        compute_dtype=dtype,
        init_std=256**-0.5,
    )
    spec = ModelSpec.from_config(m)
    rng = np.random.default_rng(seed)
    inputs, targets = (jnp.asarray(rng.integers(1, spec.vocab_size, (b, t)), jnp.int32) for _ in range(2))
    seg, positions = jnp.asarray(segment_ids), jnp.asarray(document_positions(segment_ids))
    real = seg > 0
    params = nn.unbox(jax.jit(functools.partial(init_params, Transformer(spec)))(jax.random.key(seed)))
    changed = jnp.where(seg == 1, (inputs + 1) % spec.vocab_size, inputs)  # document 1's tokens, changed

    def run(impl):  # logits and grads in one program; the leak from one forward program run on both inputs
        model = Transformer(spec.replace(attention=dict(kernel=impl)))
        logits_of = lambda p, x: model.apply({"params": p}, x, seg, positions)

        def loss(p):
            logits = logits_of(p, inputs)
            return -jnp.sum(target_logprobs(logits, targets)[0] * real) / jnp.sum(real), logits

        def outputs(p):
            (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(p)
            return logits, grads

        # the same compiled forward on both inputs: two programs could round differently (TF32, fusions)
        # and show a "leak" of ~1e-3 that is not one
        forward = jax.jit(logits_of)
        return *jax.jit(outputs)(params), forward(params, inputs), forward(params, changed)

    (want, want_g, _, _), (got, got_g, plain, got_changed) = run("reference"), run(attention)
    norm = lambda tree: math.sqrt(sum(float(jnp.sum(jnp.square(_f32(x)))) for x in jax.tree.leaves(tree)))
    rows, doc1 = real[:, :, None], (seg == 1)[:, :, None]
    errors = {
        "logits": norm(jnp.where(rows, _f32(got) - want, 0)) / norm(jnp.where(rows, want, 0)),
        "grads": norm(jax.tree.map(lambda g, w: _f32(g) - _f32(w), got_g, want_g)) / norm(want_g),
    }
    errors["leak"] = _leak(jnp.abs(got_changed - plain), doc1, rows & ~doc1)
    return errors


def unavailable(impl: str, dtype: str, device) -> str:
    """Why `impl` cannot run in `dtype` on `device` ('' if it can)."""
    if impl in ("splash", "flash") and device.platform != {"splash": "tpu", "flash": "gpu"}[impl]:
        chip = "TPU" if impl == "splash" else "GPU"
        return f"{impl} is the {chip} kernel (on {device.platform}: interpreted, for tests only)"
    if impl == "cudnn" and "cuda" not in getattr(device.client, "platform_version", "").lower():
        tpu = device.platform == "tpu"
        return f"no cuDNN on {device.platform}" + (": TPUs fuse attention with splash" if tpu else "")
    if impl == "cudnn" and dtype == "float32":
        return "cuDNN attention takes bf16/fp16 only (model.attention=cudnn needs compute_dtype=bfloat16)"
    return ""


def tolerance(dtype: str, platform: str) -> float:
    return TOLERANCE["bfloat16" if platform == "tpu" else dtype]


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}"


def judged(check: str, measure, tolerance: float) -> dict:
    """A row from `measure()`'s errors: pass if each is within tolerance (leak: LEAK_TOLERANCE); an
    exception is a failed row with its message."""
    try:
        errors = measure()
    except Exception as e:  # noqa: BLE001 - any failure of the path under test is a result to report
        return row(check, "FAIL", failure(e))
    ok = all(e <= (LEAK_TOLERANCE if name == "leak" else tolerance) for name, e in errors.items())  # NaN fails
    figure = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
    return row(check, "pass" if ok else "FAIL", figure, f"<= {tolerance:.0e}, leak <= {LEAK_TOLERANCE:.0e}")


def attention_rows(quick: bool = False) -> list[dict]:
    device = jax.devices()[0]
    seg = packed_segments(2, 128 if quick else 256)  # the fused kernels take multiples of 128 tokens
    rows = []
    for level in ("kernel", "model"):
        for impl in IMPLEMENTATIONS:
            for dtype in DTYPES:
                check = f"attention {level} {impl} {dtype}"
                if why := unavailable(impl, dtype, device):
                    rows.append(row(check, "skip", why))
                elif level == "kernel":
                    candidate = functools.partial(attend, implementation=impl)
                    measure = lambda: attention_errors(candidate, seg, dtype)
                    rows.append(judged(check, measure, tolerance(dtype, device.platform)))
                elif not quick or dtype == "bfloat16":
                    measure = lambda: model_errors(impl, dtype, seg)
                    rows.append(judged(check, measure, tolerance(dtype, device.platform)))
    return rows


# ---- throughput ---------------------------------------------------------------------------------


def mfu_peak(device_kind: str, measured: float) -> tuple[float, str]:
    """The bf16 FLOP/s that MFU divides by, and its label: the chip's vendor figure, else the measured peak."""
    chip = chip_of_kind(device_kind)
    if chip is not None:
        return chip.bf16_flops, f"{chip.name}'s vendor bf16 peak {chip.bf16_flops / 1e12:.0f} TFLOP/s"
    return measured, f"the measured matmul peak {measured / 1e12:.2f} TFLOP/s (no vendor figure for {device_kind!r})"


def throughput_rows(quick: bool = False) -> list[dict]:
    # Imported here: importing train_throughput drops a simulated device count from XLA_FLAGS.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from train_throughput import BATCH, SEQ, measure_ours

    device = jax.devices()[0]
    chip = chip_of_kind(device.device_kind)
    n = 1024 if quick else 2048 if device.platform == "cpu" else 8192
    measured = measure_matmul_peak("bfloat16", n=n, min_seconds=0.2 if quick else 1.0)
    peak, label = mfu_peak(device.device_kind, measured)
    vendor = f" = {measured / chip.bf16_flops:.0%} of {chip.name}'s {chip.bf16_flops / 1e12:.0f}" if chip else ""
    rows = [
        row(
            f"matmul peak bf16 {n}^3 ({device.device_kind})",
            "pass" if chip is None or measured <= 1.05 * chip.bf16_flops else "FAIL",
            f"{measured / 1e12:.2f} TFLOP/s{vendor}" + ("" if chip else " (no vendor figure)"),
            "<= vendor peak (else a wrong chip)",
        )
    ]
    check = f"train step bf16, {BATCH}x{SEQ} tokens (train_throughput.py)"
    try:
        ours = measure_ours("bfloat16", 3 if quick else 20, 1 if quick else 2, peak)
    except Exception as e:  # noqa: BLE001
        return rows + [row(check, "FAIL", failure(e))]
    ok = 0 < ours["mfu"] <= 1 and math.isfinite(ours["loss"])
    rows.append(
        row(
            check,
            "pass" if ok else "FAIL",
            f"{ours['tokens_per_s']:.0f} tok/s, {ours['ms_per_step']:.1f} ms/step, MFU {ours['mfu']:.1%} of {label}",
            "0 < MFU <= 100%, finite loss",
        )
    )
    return rows


# ---- rows and the table -------------------------------------------------------------------------


def row(check: str, result: str, figure: str = "", target: str = "") -> dict:
    return {"check": check, "result": result, "figure": figure, "target": target}


def append_rows(path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_rows(path) -> list[dict]:
    text = pathlib.Path(path).read_text() if os.path.exists(path) else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    headers = ("check", "result", "figure", "tolerance/target")
    cells = [headers] + [(r["check"], r["result"], r["figure"], r["target"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cells_row, widths)).rstrip() for cells_row in cells]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def exit_code(rows: list[dict]) -> int:
    """1 if any row failed or there are none, else 0 (skips, and speed below its target, do not fail)."""
    return 1 if not rows or any(r["result"] not in ("pass", "skip", "below") for r in rows) else 0


DECODE_TARGET = 2.0  # the engine's new tokens/s over transformers' generate, same device
CEILING_TARGET = 0.75  # batch 1: share of the memory-bandwidth ceiling (weight bytes / bandwidth per token)


def decode_rows(path) -> list[dict]:
    """Rows from bench/decode_throughput.py's JSON: the engine against the static decoder (target:
    at least its speed), generate, and at batch 1 the memory-bandwidth ceiling; with the share of the
    time the device sat idle, now and before decoding stayed on the device."""
    rows = []
    for r in json.loads(pathlib.Path(path).read_text()):
        check = (
            f"decode {r.get('weight_bytes', 0) / 2**30:.2f} GiB of weights, batch {r['batch']}, {r['new_tokens']} new"
        )
        static = r["ours_tokens_per_s"] / r["static_tokens_per_s"]
        figure = (
            f"engine {r['ours_tokens_per_s']:.0f} tok/s ({static:.2f}x static, idle {r['idle']:.0%}; before "
            f"{r['before_tokens_per_s']:.0f} tok/s, idle {r['idle_before']:.0%})"
        )
        rows.append(row(check + ": engine vs static", "pass" if static >= 1 else "below", figure, ">= 1.0x static"))
        if r["batch"] == 1 and "share_of_ceiling" in r:
            share = r["share_of_ceiling"]
            rows.append(
                row(
                    check + ": bandwidth ceiling",
                    "pass" if share >= CEILING_TARGET else "below",
                    f"{share:.0%} of {r['bandwidth_ceiling_tokens_per_s']:.0f} tok/s",
                    f">= {CEILING_TARGET:.0%}",
                )
            )
        if "ours_vs_peer" not in r:
            rows.append(row(check, "skip", figure + "; no transformers peer", f">= {DECODE_TARGET}x generate"))
            continue
        ratio = r["ours_vs_peer"]
        rows.append(
            row(
                check,
                "pass" if ratio >= DECODE_TARGET else "below",
                figure + f", generate {r['peer_tokens_per_s']:.0f}: {ratio:.2f}x",
                f">= {DECODE_TARGET}x generate",
            )
        )
    return rows


MOE_TARGET = 0.8  # dropless MoE tokens/s over the dense model's of equal active FLOPs


def moe_rows(path) -> list[dict]:
    """Rows from bench/moe_step.py's JSON: dropless and capacity routing against dense."""
    r = json.loads(pathlib.Path(path).read_text())
    dense = r["dense"]["tokens_per_s"]
    rows = []
    for kind, target in (("dropless", MOE_TARGET), ("capacity", None)):
        ratio = r[kind]["tokens_per_s"] / dense
        figure = f"{r[kind]['tokens_per_s']:.0f} tok/s vs dense {dense:.0f}: {ratio:.2f}x"
        result = "pass" if target is None or ratio >= target else "below"
        rows.append(row(f"MoE train step, {kind}", result, figure, f">= {target}x dense" if target else "(no target)"))
    return rows


def probe() -> int:
    device = jax.devices()[0]
    print(f"jax {jax.__version__}: {len(jax.devices())} x {device.device_kind} ({device.platform})", file=sys.stderr)
    if device.platform == "cpu" and os.environ.get("ALLOW_CPU") != "1":
        print(
            "JAX sees no accelerator (JAX_PLATFORMS=%r). On an NVIDIA GPU host install jax's CUDA plugin into the "
            "venv: .venv/bin/pip install 'jax[cuda12]==0.10.2' (or jax[cuda13]); on a Cloud TPU VM: "
            ".venv/bin/pip install 'jax[tpu]==0.10.2'. Look for jax's 'falling back to cpu' warning above. "
            "ALLOW_CPU=1 runs everything on CPU as a smoke test." % os.environ.get("JAX_PLATFORMS", ""),
            file=sys.stderr,
        )
        return 3
    print(device.platform)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("probe", "attention", "throughput", "decode", "moe", "record", "table"))
    p.add_argument("--figures", help="decode, moe: bench/decode_throughput.py's or bench/moe_step.py's --out JSON")
    p.add_argument("--rows", default="accelerator_check.jsonl")
    p.add_argument("--quick", action="store_true", help="small shapes, few steps")
    p.add_argument("--check", help="record: the row's name")
    p.add_argument("--rc", type=int, help="record: the step's exit status (0: pass)")
    p.add_argument("--skip", action="store_true", help="record: a skipped step")
    p.add_argument("--figure", default="")
    p.add_argument("--target", default="")
    args = p.parse_args(argv)
    if args.command == "probe":
        return probe()
    if args.command == "table":
        rows = read_rows(args.rows)
        print(table(rows) if rows else "no checks ran")
        return exit_code(rows)
    if args.command == "record":
        result = "skip" if args.skip else "pass" if args.rc == 0 else "FAIL"
        append_rows(args.rows, [row(args.check, result, args.figure, args.target)])
        return 0
    if args.command in ("decode", "moe"):
        rows = (decode_rows if args.command == "decode" else moe_rows)(args.figures)
    else:
        rows = attention_rows(args.quick) if args.command == "attention" else throughput_rows(args.quick)
    append_rows(args.rows, rows)
    for r in rows:
        print(f"{r['result']:4}  {r['check']}: {r['figure']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
