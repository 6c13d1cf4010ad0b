"""SFT step at GPT-2 small shape: full fine-tune against LoRA (r=8), compiled memory and tokens/s.

Both variants are built like `lm sft` builds its run (lm.train.setup.build_run with sft_loss);
the full fine-tune trains every param, LoRA sets model.lora_rank and trains only the adapters
(lm.model.lora.is_adapter), the base passed to the step as frozen params. Per variant:

- XLA's memory analysis of the compiled step (arguments, outputs, the outputs aliased to donated
  arguments, temporaries, generated code; XLA:CPU reports 0 for the code);
- the bytes of the trained params, of their optimizer state (AdamW: two moments per trained
  param) and of the frozen params, and the trained-param count;
- model FLOPs per step (lm.model.counts's convention; LoRA's frozen matrices get no weight gradient);
- tokens/s over interleaved rounds (full, LoRA, full, LoRA, ...), median round per variant,
  and the median of the per-round ratios LoRA/full. The first call of each compiled step is
  untimed (it follows the ahead-of-time compile that gives the memory analysis).

The shape is configs/gpt2_124m.py (12 layers, d_model 768, vocab 50257, LayerNorm, GELU, learned
positions, tied head, remat dots_saveable), with the sequence length, batch, depth and compute
dtype overridable so that it runs on a small CPU box; random tokens, every target counted.

    .venv/bin/python bench/sft_lora.py [--seq-len 512] [--batch-size 4] [--n-layers 12] \
        [--dtype float32] [--rounds 3] [--steps 1] [--rank 8] [--out figures.json]

Runs on one device (jax.devices()[:1]) with the XLA flags and huge-page malloc that `lm` sets
for itself (lm.process.cpu_flags, lm.process.hugepages). Prints figures only; asserts nothing.
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
    p.add_argument("--config", default=str(REPO / "configs" / "gpt2_124m.py"))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=0, help="0: the config's (12)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model.compute_dtype")
    p.add_argument("--rank", type=int, default=8, help="model.lora_rank of the LoRA variant")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (full, LoRA); medians are reported")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
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
from lm.model.lora import is_adapter  # noqa: E402
from lm.train.losses import sft_loss  # noqa: E402
from lm.train.setup import build_run, host_batch  # noqa: E402

MIB = 2**20


def make_config(args, lora_rank: int):
    overrides = [
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        "train.micro_batches=1",
        f"model.compute_dtype={args.dtype}",
        f"model.lora_rank={lora_rank}",
        "mesh.data=1",
    ]
    if args.n_layers:
        overrides.append(f"model.n_layers={args.n_layers}")
    return load_config(args.config, overrides)


def model_flops(m, seq_len: int, tokens: int) -> tuple[float, float]:
    """(full, LoRA) model FLOPs per step, lm.model.counts's convention: 6 per matmul weight per token for
    the full step; 4 for LoRA, whose frozen matrices get no weight gradient (the forward product
    and the input gradient remain); attention's products have no weights and count alike in both.
    The adapters' own products (rank r) are left out."""
    full = counts.flops_per_token(m, seq_len)
    attn = 12 * m.n_layers * m.n_heads * counts.head_dim(m) * seq_len
    return full * tokens, ((full - attn) * 4 / 6 + attn) * tokens


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


class Variant:
    """One compiled SFT step with its state, frozen params and batch, ready to be timed."""

    def __init__(self, name: str, config, lora: bool, vocab_size: int):
        self.name, self.config, self.times = name, config, []
        run = build_run(config, sft_loss, devices=jax.devices()[:1], trainable=is_adapter if lora else None)
        signature = run.signature()
        self.state, self.frozen = run.init(0)
        self.batch = run.placer(signature)(host_batch(signature, seed=0, vocab_size=vocab_size))
        args = (self.state, self.batch) + (() if self.frozen is None else (self.frozen,))
        t0 = time.perf_counter()
        self.compiled = run.train_step(signature).lower(*args).compile()
        self.compile_s = time.perf_counter() - t0
        m = self.compiled.memory_analysis()
        self.memory = {
            k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "temp", "generated_code", "alias")
        }
        self.tokens = config.train.batch_size * config.data.seq_len
        # what the step holds at once: its arguments, its outputs less those written into donated
        # argument buffers, and its temporaries
        self.memory["total"] = (
            self.memory["argument"] + self.memory["output"] - self.memory["alias"] + self.memory["temp"]
        )
        self.figures = {
            "trained_params": count(self.state.params),
            "frozen_params": count(self.frozen or {}),
            "trained_param_bytes": nbytes(self.state.params),
            "opt_state_bytes": nbytes(self.state.opt_state),
            "frozen_param_bytes": nbytes(self.frozen or {}),
            "batch_bytes": nbytes(self.batch),
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


def table(rows, headers) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(args) -> int:
    full_config, lora_config = make_config(args, 0), make_config(args, args.rank)
    m = full_config.model
    load_start = os.getloadavg()[0]
    print(
        f"jax {jax.__version__}, {os.cpu_count()} cores, device {jax.devices()[0]}, "
        f"load average {load_start:.1f}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    print(
        f"shape: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, d_ff {m.d_ff}, vocab "
        f"{m.vocab_size}, {m.mlp}, {m.norm}, remat {m.remat}, {m.compute_dtype}; batch {args.batch_size} x seq "
        f"{args.seq_len} = {args.batch_size * args.seq_len} tokens/step; {counts.param_count(m) / 1e6:.1f}M params; "
        f"LoRA r={args.rank}, alpha {lora_config.model.lora_alpha:g}",
        flush=True,
    )
    variants = []
    for name, config, lora in (("full", full_config, False), (f"LoRA r={args.rank}", lora_config, True)):
        v = Variant(name, config, lora, m.vocab_size)
        variants.append(v)
        adapted = sorted(
            {
                str(path[-1].key).rsplit("_lora_", 1)[0]
                for path, _ in jax.tree_util.tree_leaves_with_path(v.state.params)
                if is_adapter(path)
            }
        )
        print(
            f"[{name}] compiled in {v.compile_s:.1f}s; first step loss {v.loss:.3f}"
            + (f"; adapters on {', '.join(adapted)}" if adapted else ""),
            flush=True,
        )
    for r in range(args.rounds):
        line = []
        for v in variants:
            dt = v.timed(args.steps)
            line.append(f"{v.name} {dt * 1e3:.0f} ms/step ({v.tokens / dt:.0f} tok/s)")
        print(f"[round {r + 1}] " + ", ".join(line), flush=True)

    flops = model_flops(m, args.seq_len, args.batch_size * args.seq_len)
    out = {
        "shape": dict(m.to_dict(), seq_len=args.seq_len, batch_size=args.batch_size),
        "rank": args.rank,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_start": load_start,
        "variants": {},
    }
    for v in variants:
        per_round = [float(np.mean(t)) for t in v.times]
        med = statistics.median(per_round)
        v.figures |= {
            "ms_per_step_rounds": [t * 1e3 for t in per_round],
            "ms_per_step": med * 1e3,
            "ms_per_step_min": min(min(t) for t in v.times) * 1e3,
            "tokens_per_s": v.tokens / med,
            "model_flops_per_step": flops[len(out["variants"])],
        }
        v.figures["model_flops_per_s"] = v.figures["model_flops_per_step"] / med
        out["variants"][v.name] = v.figures
    full, lora = (v.figures for v in variants)
    ratios = [f / lo for f, lo in zip(full["ms_per_step_rounds"], lora["ms_per_step_rounds"])]
    out["ratio_tokens_per_s"] = statistics.median(ratios)

    mib = lambda b: f"{b / MIB:,.1f}"
    rows = []
    for v in variants:
        f = v.figures
        rows.append(
            [
                v.name,
                f"{f['trained_params']:,}",
                mib(f["trained_param_bytes"] + f["opt_state_bytes"]),
                mib(f["opt_state_bytes"]),
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
                "trained params",
                "state MiB",
                "opt state MiB",
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
    state = lambda f: f["trained_param_bytes"] + f["opt_state_bytes"]
    print(
        "state = trained params + optimizer state; XLA total = arg + out - alias + temp; GFLOP/step: model "
        "FLOPs (6 per matmul weight per token, 4 for frozen ones); ms/step: median round"
    )
    print(
        f"LoRA/full: tokens/s {out['ratio_tokens_per_s']:.2f}x (median of the per-round ratios "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"), state {state(lora) / state(full):.4f}x, temp "
        f"{lora['xla_temp_bytes'] / max(full['xla_temp_bytes'], 1):.2f}x, XLA total "
        f"{lora['xla_total_bytes'] / full['xla_total_bytes']:.2f}x, model FLOPs {flops[1] / flops[0]:.2f}x"
    )
    out["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end {out['load_average_end']:.1f} (this run alone accounts for ~2 on 2 cores)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
