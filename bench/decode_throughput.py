"""Decode throughput: new tokens/s of the engine (lm.infer.engine: paged KV cache, what every
caller generates through), against the static dense-cache decoder (tests/reference/static_decoder.py), against
recomputing the whole forward pass per token, and against Hugging Face transformers `generate`
on the same machine.

Shape: a small Llama (6 layers, d_model 384, 6 heads over 2 kv heads, SwiGLU 1024, RoPE, tied
embeddings, vocabulary 2048), float32, random weights, greedy, 16-token prompts, at batch 1 and
16 and for 256 and 1024 new tokens. Ours and the peer alternate in rounds (the machine's speed
drifts); medians of the rounds are reported. The engine runs twice per round: as it is, and as it
was before decoding stayed on the device between row ends (`engine_before`: 64-step calls, the
loop's condition read after every step); for both it prints the share of the wall time the device
sat idle (the host's time between calls: 1 - the time from each call's launch to its results).

    PYTHONPATH=. python bench/decode_throughput.py [--rounds 2] [--peer-python /tmp/hf-venv/bin/python]
    PYTHONPATH=. python bench/decode_throughput.py --shape 1b --dtype bfloat16 --batches 1,16,64  # a GPU

On a known accelerator (lm.plan.hardware) each row also gives the memory-bandwidth ceiling
(batch x bandwidth / weight bytes: every step reads every weight once) and the share of it reached.

The recompute baseline is one jitted full forward pass over a fixed buffer of prompt + new
tokens per new token (one compile, as lm's sampler did before the cache): its cost per token is
the same at every step, so it is timed over a few steps and reported per token. Prints
figures only; asserts nothing.
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# No lm.cpu_flags defaults, as in `lm sample`: they pick XLA:CPU's Eigen matmuls, faster for
# training's large float32 products, while XLA's own default (YNNPACK) is faster for decoding's
# few rows (1,850 vs 1,400 tokens/s at batch 16 in one run).
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config  # noqa: E402
from lm.infer.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402
from lm.plan.hardware import chip_of_kind  # noqa: E402
from tests.reference.static_decoder import StaticGenerator  # noqa: E402

SHAPES = {
    "small": dict(vocab=2048, d_model=384, layers=6, heads=6, kv_heads=2, d_ff=1024),
    # Llama-3.2-1B's shape (1.24B parameters, tied embeddings): for an accelerator
    "1b": dict(vocab=128256, d_model=2048, layers=16, heads=32, kv_heads=8, d_ff=8192),
}
SHAPE = dict(SHAPES["small"])  # the shape measured (--shape)
DTYPE = ["float32"]  # params and compute (--dtype)
PROMPT = 16
PEER = pathlib.Path(__file__).resolve().parent / "hf_generate_peer.py"


def spec(max_len: int) -> ModelSpec:
    s, m = SHAPE, base_config().model  # the rest as the config's defaults; head_dim derived
    m.update(
        vocab_size=s["vocab"],
        d_model=s["d_model"],
        n_layers=s["layers"],
        n_heads=s["heads"],
        n_kv_heads=s["kv_heads"],
        d_ff=s["d_ff"],
        max_seq_len=max_len,
        attention="reference",
        compute_dtype=DTYPE[0],
    )
    return ModelSpec.from_config(m)


def prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(3, SHAPE["vocab"], (batch, PROMPT)).tolist()


# The engine as it runs now, and as it ran before decoding stayed on the device for up to 256
# steps (64-step calls, the loop's condition checked after every step).
ENGINES = {"engine": EngineConfig(), "engine_before": EngineConfig(idle_block=64, check_every=1)}


class Ours:
    """Compiled once per (batch, new tokens); each call is a whole generation."""

    def __init__(self, batch: int, new: int):
        self.model = Transformer(spec(PROMPT + new))
        dtype = jnp.dtype(DTYPE[0])
        self.params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(dtype), nn.unbox(init_params(self.model, k))))(
            jax.random.PRNGKey(0)
        )
        self.weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
        self.sampling = SamplingParams(max_new_tokens=new, temperature=0)
        self.static = StaticGenerator(self.model, self.params, self.sampling, eos_id=-1)
        self.prompts, self.tokens = prompts(batch), batch * new
        self.idle = {name: [] for name in ENGINES}  # per round: the share of the time the device waited
        want = self.static(self.prompts).ids  # compile
        for name in ENGINES:
            got = self.engine(name)[1]
            assert all(r.ids == w.tolist() for r, w in zip(got, want)), f"{name} and the static decoder differ"

    def engine(self, name: str) -> tuple[float, list]:
        config = dataclasses.replace(ENGINES[name], slots=len(self.prompts))
        engine = Engine(self.model, max_len=self.model.spec.max_seq_len, config=config)
        reqs = [Request(list(p), self.sampling, eos=(-1,)) for p in self.prompts]
        start = time.perf_counter()
        engine.run(self.params, reqs)
        wall = time.perf_counter() - start
        self.idle[name].append(1 - engine.device_s / wall)
        return wall, reqs

    def tokens_per_s(self, which: str = "engine") -> float:
        if which in ENGINES:
            return self.tokens / self.engine(which)[0]
        start = time.perf_counter()
        self.static(self.prompts)
        return self.tokens / (time.perf_counter() - start)

    def recompute_tokens_per_s(self, steps: int = 8) -> float:
        """One full forward pass over the [batch, prompt + new] buffer per new token."""
        b, total = len(self.prompts), self.model.spec.max_seq_len
        buf = jnp.zeros((b, total), jnp.int32).at[:, :PROMPT].set(jnp.asarray(self.prompts, jnp.int32))
        seg, pos = jnp.ones((b, total), jnp.int32), jnp.broadcast_to(jnp.arange(total), (b, total))

        @jax.jit
        def step(params, buf, t):
            logits = self.model.apply({"params": params}, buf, seg, pos)
            nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, axis=1, keepdims=False), -1)
            return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(jnp.int32)[:, None], t, axis=1)

        buf = step(self.params, buf, PROMPT).block_until_ready()  # compile
        start = time.perf_counter()
        for t in range(PROMPT + 1, PROMPT + 1 + steps):
            buf = step(self.params, buf, t)
        buf.block_until_ready()
        return b * steps / (time.perf_counter() - start)


def peer(python: str, batch: int, new: int, device: str = "cpu") -> float | None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    cmd = [
        python,
        str(PEER),
        "--batch",
        str(batch),
        "--new-tokens",
        str(new),
        "--prompt-len",
        str(PROMPT),
        "--repeats",
        "1",
        "--device",
        device,
        "--dtype",
        DTYPE[0],
        *flags,
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    )
    if done.returncode:
        print(f"peer failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peer-python", help="a Python with torch and transformers (e.g. /tmp/hf-venv/bin/python)")
    p.add_argument("--peer-device", default="cpu", help="where the peer runs: cpu, or cuda beside a GPU run of ours")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", default="256,1024")
    p.add_argument("--shape", choices=tuple(SHAPES), default="small", help="the model (1b: for an accelerator)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="params and compute")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    SHAPE.update(SHAPES[args.shape])
    DTYPE[0] = args.dtype
    chip = chip_of_kind(jax.devices()[0].device_kind)
    rows = []
    for batch in [int(x) for x in args.batches.split(",")]:
        for new in [int(x) for x in args.new_tokens.split(",")]:
            ours = Ours(batch, new)
            mine, before, static, theirs = [], [], [], []
            for _ in range(args.rounds):
                mine.append(ours.tokens_per_s())
                before.append(ours.tokens_per_s("engine_before"))
                static.append(ours.tokens_per_s("static"))
                if args.peer_python:
                    theirs.append(peer(args.peer_python, batch, new, args.peer_device))
            recompute = ours.recompute_tokens_per_s()
            row = {
                "batch": batch,
                "new_tokens": new,
                "ours_tokens_per_s": statistics.median(mine),
                "before_tokens_per_s": statistics.median(before),
                "static_tokens_per_s": statistics.median(static),
                "idle": statistics.median(ours.idle["engine"][1:]),
                "idle_before": statistics.median(ours.idle["engine_before"][1:]),
                "recompute_tokens_per_s": recompute,
                "rounds": mine,
                "static_rounds": static,
            }
            row["cache_vs_recompute"] = row["ours_tokens_per_s"] / recompute
            row["weight_bytes"] = ours.weight_bytes
            if chip is not None:  # every step reads every weight once: the batch-1 ceiling
                row["bandwidth_ceiling_tokens_per_s"] = batch * chip.hbm_bytes_per_s / ours.weight_bytes
                row["share_of_ceiling"] = row["ours_tokens_per_s"] / row["bandwidth_ceiling_tokens_per_s"]
            if theirs and None not in theirs:
                row |= {
                    "peer_tokens_per_s": statistics.median(theirs),
                    "peer_rounds": theirs,
                    "ours_vs_peer": statistics.median(m / t for m, t in zip(mine, theirs)),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n{'batch':>5} {'new':>5} {'engine tok/s':>12} {'idle':>5} {'before':>7} {'idle':>5} {'static':>7} "
        f"{'recompute':>10} {'cache x':>8} {'HF tok/s':>9} {'engine/HF':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['new_tokens']:>5} {r['ours_tokens_per_s']:>12.0f} {r['idle']:>5.1%} "
            f"{r['before_tokens_per_s']:>7.0f} {r['idle_before']:>5.1%} {r['static_tokens_per_s']:>7.0f} "
            f"{r['recompute_tokens_per_s']:>10.1f} "
            f"{r['cache_vs_recompute']:>8.1f} {r.get('peer_tokens_per_s', float('nan')):>9.0f} "
            f"{r.get('ours_vs_peer', float('nan')):>9.2f}"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
