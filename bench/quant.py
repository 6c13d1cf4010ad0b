"""Weight-only quantization on a trained model: float vs int8 vs int4.

For each variant of the same checkpoint (`lm.model.quant.quantize_for_inference`) it prints the
held-out bits per byte of the pretraining text and the exact match of greedy chat answers on
the held-out task (both through lm.eval, as `lm eval` and the demo score them), the weight
memory (all params, and the leaves that get quantized) with its ratio to float, greedy decode
tokens/s at batch 1 and 16 (the variants alternate in rounds; medians and the median ratio to
float within a round), and what this backend compiles one int8 product to at those batches (the
ops of the program: on XLA:CPU a "__ynn_fusion" with an s32 output is the s8 x s8 dot reading
the int8 weight in place; a float output the size of the weight would be a dequantized copy).

    PYTHONPATH=. python bench/quant.py [--run runs/demo-hf/sft] [--rounds 3] [--new-tokens 64]
    PYTHONPATH=. python bench/quant.py --random d_model=2048,n_layers=24 [--dtype bfloat16]

Defaults: the demo's SFT model, its task's held-out conversations and its pretraining run's
held-out shards. --random: a model of random weights of that shape (config.model keys over the
defaults) instead: no quality figures but the logits' relative distance to float32, and a bf16
copy of the weights as a second baseline (the compute dtype is --dtype). Prints figures only;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config, rules_table  # noqa: E402
from lm.infer.generate import Generator  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.model.build import build_model  # noqa: E402
from lm.model.qdot import qdot  # noqa: E402
from lm.model.quant import CONTRACTING, quantize, quantize_for_inference, weight_bytes  # noqa: E402
from lm.model.transformer import init_params  # noqa: E402

MODES = ("int8", "int4")


def variants(built, params, baselines: dict) -> dict:
    out = dict(baselines)
    for mode in MODES:
        out[mode] = jax.block_until_ready(quantize_for_inference(built, params, mode))
    return out


def float_bytes_of_quantized_leaves(params: dict) -> int:
    def walk(tree):
        for k, v in tree.items():
            yield from walk(v) if isinstance(v, dict) else ([v.nbytes] if k in CONTRACTING else [])

    return sum(walk(params))


def quality(built, loaded, params: dict, heldout: str, task: str, batch_size: int) -> dict:
    from lm.eval.loglik import Scorer
    from lm.eval.tasks import parse_task, run_task

    scorer = Scorer(
        built.module, params["float"], loaded.tokenizer, mesh=built.mesh, rules=built.rules, batch_size=batch_size
    )
    out = {}
    for mode, p in params.items():
        scorer.params = p
        start = time.perf_counter()
        lm = run_task(parse_task(heldout), scorer)["metrics"]
        gen = run_task(parse_task(task), scorer)["metrics"]
        out[mode] = {
            "bits_per_byte": lm["bits_per_byte"],
            "exact_match": gen["exact"],
            "eval_s": time.perf_counter() - start,
        }
        print(json.dumps({"mode": mode} | out[mode]), flush=True)
    return out


def decode_speed(built, params: dict, prompts: list, batch: int, new: int, rounds: int) -> dict:
    sampling = SamplingParams(max_new_tokens=new, temperature=0)
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    gens = {
        m: Generator(built.module, p, sampling, eos_id=-1, mesh=built.mesh, rules=built.rules)
        for m, p in params.items()
    }
    for g in gens.values():
        g(rows)  # compile
    speed = {m: [] for m in gens}
    for _ in range(rounds):
        for m, g in gens.items():
            start = time.perf_counter()
            g(rows)
            speed[m].append(batch * new / (time.perf_counter() - start))
    return {
        m: {
            "tokens_per_s": statistics.median(s),
            "vs_float": statistics.median(a / b for a, b in zip(s, next(iter(speed.values())))),
            "rounds": s,
        }
        for m, s in speed.items()
    }


def product_ops(built, rows: int) -> list[str]:
    """What this backend compiles one int8 product to (x [rows, 1, d_model] @ w_up [d_model, d_ff]
    as the model runs it): each op of the program's entry, as `op(fusion kind) -> output`. An s8
    operand of the dot (a "__ynn_fusion" with an s32 output on XLA:CPU) means no float weight."""
    s = built.spec
    q = quantize(jnp.zeros((s.d_model, s.mlp.d_ff)), 8, *CONTRACTING["w_up"])
    x = jnp.zeros((rows, 1, s.d_model), s.dtype)
    fn = jax.jit(lambda x, q: qdot("btd,df->btf", x, q, int_dot=s.cpu_kernels))
    ops = []
    for line in fn.lower(x, q).compile().as_text().split("ENTRY")[1].splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\(", line)
        if not m or m.group(2) in ("parameter", "constant", "bitcast", "tuple", "get-tuple-element"):
            continue
        kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=(\w+)", line)
        ops.append(f"{m.group(2)}({kind.group(1)}) -> {m.group(1)}" if kind else f"{m.group(2)} -> {m.group(1)}")
    return ops


def demo(args) -> tuple[dict, dict, dict, list]:
    """(built, params variants, quality, prompts) of a trained model."""
    from lm.data.chat import ChatTemplate, prompt_ids
    from lm.eval.answers import read_conversations
    from lm.eval.suite import HELDOUT_TOKENS, pretraining_shards
    from lm.store.load import load_trained

    loaded = load_trained(args.run, None, None)
    built = build_model(loaded.config, rules=rules_table(loaded.config))
    print(f"model {loaded.source}")
    heldout = args.heldout or pretraining_shards(pathlib.Path(args.run).parent / "pretrain")[1][0]
    params = variants(built, loaded.params, {"float": built.place(loaded.params)})
    scores = quality(
        built,
        loaded,
        params,
        f"heldout={heldout}?limit={HELDOUT_TOKENS}",
        f"task={args.task}",
        loaded.config.eval.batch_size,
    )
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    prompts = [prompt_ids(template, c[:-1]) for c in read_conversations(args.task, 64)]
    return built, params, scores, prompts


def random_model(args) -> tuple[dict, dict, dict, list]:
    """(built, params variants, logits' distance to float32, prompts) of a model of random weights."""
    config = base_config()
    config.model.update(compute_dtype=args.dtype, max_seq_len=512, remat="none")
    for key, value in (kv.split("=") for kv in args.random.split(",")):
        old = config.model[key]
        config.model[key] = value.lower() == "true" if isinstance(old, bool) else type(old)(value)
    built = build_model(config, rules=rules_table(config))
    print(f"model random {dict(config.model.items())}")
    init = jax.jit(lambda k: nn.unbox(init_params(built.module, k)), out_shardings=built.param_shardings)
    params = init(jax.random.PRNGKey(0))
    bf16 = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))(params)
    params = variants(built, params, {"f32": params, "bf16": bf16})
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, config.model.vocab_size, (8, 128)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), ids.shape)
    forward = jax.jit(lambda p: built.module.apply({"params": p}, ids, jnp.ones_like(ids), pos))
    ref = forward(params["f32"])
    dist = {
        m: {"logits_rel_err": float(jnp.linalg.norm(forward(p) - ref) / jnp.linalg.norm(ref))}
        for m, p in params.items()
    }
    for m, d in dist.items():
        print(json.dumps({"mode": m} | d), flush=True)
    prompts = rng.integers(3, config.model.vocab_size, (64, 16)).tolist()
    return built, params, dist, prompts


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="runs/demo-hf/sft")
    p.add_argument("--task", default="runs/demo-hf/task/heldout.jsonl")
    p.add_argument("--heldout", help="held-out text set (default: the demo pretraining run's held-out shards)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--random", help="a random model of this shape, e.g. d_model=2048,n_layers=24,d_ff=5632")
    p.add_argument("--dtype", default="bfloat16", help="--random: the compute dtype")
    args = p.parse_args()

    built, params, scores, prompts = random_model(args) if args.random else demo(args)
    first = next(iter(params))
    base = float_bytes_of_quantized_leaves(params[first])
    memory = {m: weight_bytes(p) for m, p in params.items()}
    for m in params:
        if m not in MODES:
            memory[m]["quantized"] = float_bytes_of_quantized_leaves(params[m])
    speeds = {
        b: decode_speed(built, params, prompts, b, args.new_tokens, args.rounds)
        for b in [int(x) for x in args.batches.split(",")]
    }
    for b, s in speeds.items():
        print(json.dumps({"batch": b, "new_tokens": args.new_tokens} | s), flush=True)
    for b in speeds:
        print(f"int8 product at batch {b} ({built.spec.compute_dtype}): " + "; ".join(product_ops(built, b)))

    print(
        f"\n{jax.devices()[0].device_kind} x{len(jax.devices())}; decode: greedy, {args.new_tokens} new tokens, "
        f"median of {args.rounds} interleaved rounds; ratios against {first}"
    )
    quality_head = f"{'logits err':>10}" if args.random else f"{'bits/byte':>9} {'exact':>6}"
    head = f"{'mode':<6} {quality_head} {'all MB':>8} {'ratio':>6} {'quant MB':>8} {'ratio':>6}"
    head += "".join(f" {f'tok/s b{b}':>10} {'ratio':>6}" for b in speeds)
    print(head)
    for m in params:
        mem, s = memory[m], scores[m]
        q = f"{s['logits_rel_err']:>10.4f}" if args.random else f"{s['bits_per_byte']:>9.4f} {s['exact_match']:>6.1%}"
        line = (
            f"{m:<6} {q} {mem['all'] / 1e6:>8.2f} {mem['all'] / memory[first]['all']:>6.3f} "
            f"{mem['quantized'] / 1e6:>8.2f} {mem['quantized'] / base:>6.3f}"
        )
        line += "".join(f" {speeds[b][m]['tokens_per_s']:>10.0f} {speeds[b][m]['vs_float']:>6.2f}" for b in speeds)
        print(line)


if __name__ == "__main__":
    main()
