"""DPO step at GPT-2 small shape: a live reference model against precomputed reference log-probs.

Both variants are built like `lm dpo` builds its run (lm.train.dpo.build_dpo_run, sigmoid loss,
every param trained). dpo.reference=live holds the reference model (a copy of the init params in
the compute dtype) as a frozen argument of the step and runs its forward pass on every step;
dpo.reference=precomputed feeds its log-probs as a per-pair batch field ('ref_logps' [B, 2]
float32), so the step holds one model. Per variant:

- XLA's memory analysis of the compiled step (arguments, outputs, the outputs aliased to donated
  arguments, temporaries, generated code; XLA:CPU reports 0 for the code);
- the bytes of the trained params, of their optimizer state (AdamW: two moments per param), of
  the frozen params (the reference copy; live only) and of the batch;
- model FLOPs per step (lm.model.counts's convention over both rows of every pair: 6N per token for the
  policy's forward and backward, plus 2N for the live reference's forward, i.e. x 4/3 as lm dpo
  counts it);
- tokens/s over interleaved rounds (live, precomputed, live, precomputed, ...), median round per
  variant, and the median of the per-round ratios precomputed/live. The first call of each
  compiled step is untimed (it follows the ahead-of-time compile that gives the memory analysis).

The precomputed variant also needs the one-off pass that computes the reference log-probs
(lm.train.dpo.reference_logps, batches of --batch-size pairs). Each call compiles its own jitted
forward, so it is timed over one batch and over --precompute-batches batches: the difference gives
the steady seconds per 1000 pairs (the compile drops out), the one-batch call the fixed cost.
A reader adds the former to the precomputed step's time for an epoch; the script does it too.

The shape is configs/gpt2_124m.py (12 layers, d_model 768, vocab 50257, LayerNorm, GELU, learned
positions, tied head, remat dots_saveable), with the sequence length, batch (pairs per step),
depth and compute dtype overridable so that it runs on a small CPU box; random tokens in both
rows of a pair, every target counted, the reference log-probs (precomputed) and margins random.

    .venv/bin/python bench/dpo_reference.py [--seq-len 256] [--batch-size 4] [--n-layers 12] \
        [--dtype float32] [--rounds 3] [--steps 1] [--precompute-batches 4] [--out figures.json]

Runs on one device (jax.devices()[:1]) with the XLA flags and huge-page malloc that `lm` sets
for itself (lm.process.cpu_flags, lm.process.hugepages). Prints figures only; asserts nothing.
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

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpt2_124m.py"))
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (each pair is two rows)")
    p.add_argument("--batch-size", type=int, default=4, help="pairs per step (and per precompute batch)")
    p.add_argument("--n-layers", type=int, default=0, help="0: the config's (12)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model.compute_dtype")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (live, precomputed); medians are reported")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    p.add_argument(
        "--precompute-batches",
        type=int,
        default=4,
        help="batches of the timed reference log-prob pass (>= 2; also timed over one batch)",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None

# One real CPU device (drop a simulated-device count inherited from the environment), the XLA
# flags `lm train` applies for the compute dtype, and huge-page malloc as the `lm` command gets it.
os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
if ARGS is not None:
    from lm.process.cpu_flags import apply_cpu_defaults
    from lm.process.hugepages import reexec_with_hugepages

    reexec_with_hugepages()
    apply_cpu_defaults(ARGS.dtype)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import load_config  # noqa: E402
from lm.model import counts  # noqa: E402
from lm.train.dpo import build_dpo_run, reference_logps  # noqa: E402
from lm.train.pair_losses import DpoSettings  # noqa: E402
from lm.train.pairs import PAIR_EXTRA  # noqa: E402
from lm.train.setup import host_batch  # noqa: E402

MIB = 2**20
REF_FIELD = {"ref_logps": ((2,), np.float32)}


def make_config(args, reference: str):
    overrides = [
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        "train.micro_batches=1",
        f"model.compute_dtype={args.dtype}",
        "dpo.loss=sigmoid",
        f"dpo.reference={reference}",
        "mesh.data=1",
    ]
    if args.n_layers:
        overrides.append(f"model.n_layers={args.n_layers}")
    return load_config(args.config, overrides)


def pair_batch(signature: dict, seed: int, vocab_size: int) -> dict:
    """Random host arrays of a pair signature ([B, 2, T] text fields): host_batch's, with the
    positions 0..T-1 along the last axis (host_batch takes them along axis 1, which for pairs is
    the chosen/rejected axis of length 2)."""
    text = {k: v for k, v in signature.items() if k != "positions"}
    out = host_batch(text, seed=seed, vocab_size=vocab_size)
    s = signature["positions"]
    out["positions"] = np.broadcast_to(np.arange(s.shape[-1], dtype=s.dtype), s.shape).copy()
    return {k: out[k] for k in signature}


def nbytes(tree) -> int:
    """Bytes of a tree's distinct buffers (a LoRA policy's reference is its base: counted once)."""
    leaves = {id(x): x for x in jax.tree.leaves(tree)}
    return sum(x.size * x.dtype.itemsize for x in leaves.values())


class Variant:
    """One compiled DPO step with its state, frozen params and batch, ready to be timed."""

    def __init__(self, name: str, run, base: dict, vocab_size: int):
        self.name, self.run, self.times = name, run, []
        extra = PAIR_EXTRA | (REF_FIELD if name == "precomputed" else {})
        signature = run.signature(pairs=True, extra=extra)
        self.state, self.frozen = run.init(0, base=base)
        self.batch = run.placer(signature)(pair_batch(signature, seed=0, vocab_size=vocab_size))
        args = (self.state, self.batch) + (() if self.frozen is None else (self.frozen,))
        t0 = time.perf_counter()
        self.compiled = run.train_step(signature).lower(*args).compile()
        self.compile_s = time.perf_counter() - t0
        m = self.compiled.memory_analysis()
        self.memory = {
            k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "temp", "generated_code", "alias")
        }
        config = run.config
        self.tokens = config.train.batch_size * 2 * config.data.seq_len  # both rows of every pair
        # what the step holds at once: its arguments, its outputs less those written into donated
        # argument buffers, and its temporaries
        self.memory["total"] = (
            self.memory["argument"] + self.memory["output"] - self.memory["alias"] + self.memory["temp"]
        )
        self.figures = {
            "trained_param_bytes": nbytes(self.state.params),
            "opt_state_bytes": nbytes(self.state.opt_state),
            "frozen_param_bytes": nbytes(self.frozen or {}),
            "batch_bytes": nbytes(self.batch),
            "tokens_per_step": self.tokens,
            "pairs_per_step": config.train.batch_size,
            "compile_s": self.compile_s,
            **{f"xla_{k}_bytes": v for k, v in self.memory.items()},
        }
        self.loss = float(self.step()["loss"])  # the first call: untimed

    def step(self):
        args = (self.state, self.batch) + (() if self.frozen is None else (self.frozen,))
        self.state, metrics = self.compiled(*args)
        jax.block_until_ready((self.state, metrics))
        return metrics

    def timed(self, steps: int) -> float:
        """Mean seconds per step over `steps` steps, each blocked on."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        self.times.append(times)
        return float(np.mean(times))


def time_precompute(run, base: dict, batch_size: int, n_batches: int, vocab_size: int) -> dict:
    """Seconds of reference_logps over one batch and over n_batches batches of pairs (each call
    compiles its own forward); the difference gives the steady cost per pair."""
    signature = run.signature(batch_size * n_batches, pairs=True, extra=PAIR_EXTRA)
    host = pair_batch(signature, seed=1, vocab_size=vocab_size)
    rows = [{k: v[i] for k, v in host.items()} for i in range(batch_size * n_batches)]
    walls = {}
    for n in (1, n_batches):
        t0 = time.perf_counter()
        logps = reference_logps(run, base, rows[: n * batch_size], batch_size)
        walls[n] = time.perf_counter() - t0
    per_pair = (walls[n_batches] - walls[1]) / ((n_batches - 1) * batch_size)
    return {
        "pairs": n_batches * batch_size,
        "batch_size": batch_size,
        "wall_s_1_batch": walls[1],
        f"wall_s_{n_batches}_batches": walls[n_batches],
        "s_per_1000_pairs": per_pair * 1000,
        "s_per_1000_pairs_incl_compile": walls[n_batches] / (n_batches * batch_size) * 1000,
        "fixed_s": walls[1] - per_pair * batch_size,
        "first_logps": [float(x) for x in logps[0]],
    }


def table(rows, headers) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(args) -> int:
    if args.precompute_batches < 2:
        print("--precompute-batches must be >= 2 (the pass is timed over one batch and over this many)")
        return 2
    live_config, pre_config = make_config(args, "live"), make_config(args, "precomputed")
    m = live_config.model
    devices = jax.devices()[:1]
    load_start = os.getloadavg()[0]
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, device {devices[0]}, "
        f"load average {load_start:.1f}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    print(
        f"shape: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, d_ff {m.d_ff}, vocab "
        f"{m.vocab_size}, {m.mlp}, {m.norm}, remat {m.remat}, {m.compute_dtype}; {args.batch_size} pairs x 2 "
        f"rows x seq {args.seq_len} = {args.batch_size * 2 * args.seq_len} tokens/step; "
        f"{counts.param_count(m) / 1e6:.1f}M params; DPO {live_config.dpo.loss}, "
        f"beta {DpoSettings.from_config(live_config.dpo).loss_beta:g}",
        flush=True,
    )
    pre_run = build_dpo_run(pre_config, devices=devices)
    # the init model: the fresh params of a run of the same config, on the host (np.array copies,
    # so the donated state of a step cannot reuse the buffers they came from)
    base = jax.tree.map(np.array, jax.device_get(pre_run.init_state(0).params))
    print(f"init params on the host: {nbytes(base) / MIB:,.1f} MiB", flush=True)
    variants = []
    for name, run in (("live", build_dpo_run(live_config, devices=devices)), ("precomputed", pre_run)):
        v = Variant(name, run, base, m.vocab_size)
        variants.append(v)
        print(
            f"[{name}] compiled in {v.compile_s:.1f}s; first step loss {v.loss:.4f}; frozen "
            f"{v.figures['frozen_param_bytes'] / MIB:,.1f} MiB",
            flush=True,
        )
    for r in range(args.rounds):
        line = []
        for v in variants:
            dt = v.timed(args.steps)
            line.append(f"{v.name} {dt * 1e3:.0f} ms/step ({v.tokens / dt:.0f} tok/s)")
        print(f"[round {r + 1}] " + ", ".join(line), flush=True)
    pre = time_precompute(pre_run, base, args.batch_size, args.precompute_batches, m.vocab_size)
    print(
        f"[precompute] reference_logps over {args.batch_size} pairs: {pre['wall_s_1_batch']:.1f}s, over "
        f"{pre['pairs']} pairs: {pre[f'wall_s_{args.precompute_batches}_batches']:.1f}s (each incl. its compile)",
        flush=True,
    )

    per_token = counts.flops_per_token(m, args.seq_len)
    out = {
        "shape": dict(m.to_dict(), seq_len=args.seq_len, batch_size=args.batch_size),
        "dpo": dict(live_config.dpo.to_dict()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_start": load_start,
        "variants": {},
        "precompute": pre,
    }
    for v in variants:
        per_round = [float(np.mean(t)) for t in v.times]
        med = statistics.median(per_round)
        flops = per_token * v.tokens * (4 / 3 if v.name == "live" else 1)  # as lm dpo counts it
        v.figures |= {
            "ms_per_step_rounds": [t * 1e3 for t in per_round],
            "ms_per_step": med * 1e3,
            "ms_per_step_min": min(min(t) for t in v.times) * 1e3,
            "tokens_per_s": v.tokens / med,
            "model_flops_per_step": flops,
            "model_flops_per_s": flops / med,
        }
        out["variants"][v.name] = v.figures
    live, prec = (v.figures for v in variants)
    ratios = [lv / p for lv, p in zip(live["ms_per_step_rounds"], prec["ms_per_step_rounds"])]
    out["ratio_tokens_per_s"] = statistics.median(ratios)
    # an epoch of 1000 pairs: steps at the median round, plus the one-off pass for precomputed
    steps_1000 = 1000 / args.batch_size
    epoch = {
        "live_s_per_1000_pairs": steps_1000 * live["ms_per_step"] / 1e3,
        "precomputed_s_per_1000_pairs": steps_1000 * prec["ms_per_step"] / 1e3,
        "reference_in_step_s_per_1000_pairs": steps_1000 * (live["ms_per_step"] - prec["ms_per_step"]) / 1e3,
    }
    epoch["precomputed_with_pass_s_per_1000_pairs"] = epoch["precomputed_s_per_1000_pairs"] + pre["s_per_1000_pairs"]
    epoch["ratio_with_pass"] = epoch["live_s_per_1000_pairs"] / epoch["precomputed_with_pass_s_per_1000_pairs"]
    out["epoch"] = epoch

    mib = lambda b: f"{b / MIB:,.1f}"
    rows = []
    for v in variants:
        f = v.figures
        rows.append(
            [
                v.name,
                mib(f["trained_param_bytes"] + f["opt_state_bytes"]),
                mib(f["frozen_param_bytes"]),
                mib(f["xla_argument_bytes"]),
                mib(f["xla_output_bytes"]),
                mib(f["xla_alias_bytes"]),
                mib(f["xla_temp_bytes"]),
                mib(f["xla_total_bytes"]),
                f"{f['xla_generated_code_bytes'] / MIB:.2f}",
                f"{f['model_flops_per_step'] / 1e9:,.0f}",
                f"{f['model_flops_per_s'] / 1e9:.0f}",
                f"{f['ms_per_step']:,.0f}",
                f"{f['tokens_per_s']:,.0f}",
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "variant",
                "state MiB",
                "frozen MiB",
                "XLA arg MiB",
                "XLA out MiB",
                "XLA alias MiB",
                "XLA temp MiB",
                "XLA total MiB",
                "code MiB",
                "GFLOP/step",
                "GFLOP/s",
                "ms/step",
                "tok/s",
            ],
        )
    )
    print(
        "state = params + AdamW moments; frozen = the reference copy; XLA total = arg + out - alias + temp; "
        "GFLOP/step: model FLOPs (6N per token, 8N with the live reference); ms/step: median round; tokens: "
        "both rows of every pair"
    )
    print(
        f"precomputed/live: tokens/s {out['ratio_tokens_per_s']:.2f}x (median of the per-round ratios "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"), temp {prec['xla_temp_bytes'] / live['xla_temp_bytes']:.2f}x,"
        f" XLA total {prec['xla_total_bytes'] / live['xla_total_bytes']:.2f}x, model FLOPs 0.75x"
    )
    print(
        f"precompute pass: {pre['s_per_1000_pairs']:,.0f} s per 1000 pairs (steady, from the {args.batch_size}- "
        f"and {pre['pairs']}-pair calls; {pre['s_per_1000_pairs_incl_compile']:,.0f} with the {pre['pairs']}-pair "
        f"call's compile), fixed cost ~{pre['fixed_s']:.1f} s per call; the live step's reference share "
        f"(live - precomputed) is {epoch['reference_in_step_s_per_1000_pairs']:,.0f} s per 1000 pairs"
    )
    print(
        f"one epoch per 1000 pairs: live {epoch['live_s_per_1000_pairs']:,.0f} s; precomputed "
        f"{epoch['precomputed_s_per_1000_pairs']:,.0f} s + pass {pre['s_per_1000_pairs']:,.0f} s = "
        f"{epoch['precomputed_with_pass_s_per_1000_pairs']:,.0f} s (live/that {epoch['ratio_with_pass']:.2f}x)"
    )
    out["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end {out['load_average_end']:.1f} (this run alone accounts for ~2 on 2 cores)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
