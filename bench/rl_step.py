"""One RL step (`lm rl`, GRPO): rollout and update throughput, and the share of the step spent sampling.

The step is lm.train.rl_step.RlStep as `lm rl` builds it: P prompts x G samples with the
KV-cache sampler (temperature 1), a reward function (here the share of digits: cheap, so the
step's time is the model's), the scoring pass (the reference's per-token log-probs, beta > 0),
group advantages, then `--epochs` x `--minibatches` jitted updates. Per round it reports:

- rollout tokens/s: new tokens sampled / seconds in the sampler (prefill included);
- update tokens/s: row tokens through the updates / seconds in them;
- sampling share: sampler seconds / (sampler + update seconds) of the step.

Peers, measured in the same rounds (interleaved: RL step, peers, RL step, ...):
- the same RL step with the static dense-cache decoder as its sampler (tests/reference/static_decoder.py,
  how rollouts were sampled before the engine): step seconds and sampling share before/after;
- the sampler alone: lm.infer.generate.Generator on the same prompts, as `lm sample` runs it
  (ratio rollout / sampler: what the rollout path adds, e.g. folding the policy's params);
- a pretraining step (lm.train.setup.build_run, next-token loss) on rows of the same shape
  (ratio RL update / pretraining step: what the RL loss's extra terms cost).
Medians over rounds; the first call of everything is untimed (compiles). The model is random
(its responses run to --max-new-tokens), the prompts random tokens of --prompt-len.

    .venv/bin/python bench/rl_step.py [--config configs/tiny.py] [--prompts 16] [--group 8] \
        [--prompt-len 16] [--max-new-tokens 16] [--epochs 1] [--minibatches 1] [--rounds 3] \
        [--n-layers 0] [--dtype float32] [--out figures.json]

One device (jax.devices()[:1]) with the XLA flags and huge-page malloc `lm` sets for itself.
Prints figures only; asserts nothing.
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
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--n-layers", type=int, default=0, help="0: the config's")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
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
from lm.data.prompts import PromptSet  # noqa: E402
from lm.data.tokenizer import ByteTokenizer  # noqa: E402
from lm.infer.generate import Generator  # noqa: E402
from lm.infer.sampling import SamplingParams  # noqa: E402
from lm.train.rewards import RewardFn, Rewards  # noqa: E402
from lm.train.rl import build_rl_run  # noqa: E402
from lm.train.rl_losses import RlSettings  # noqa: E402
from lm.train.rl_step import RlStep  # noqa: E402
from lm.train.rollout import Sampler, Scorer  # noqa: E402
from lm.train.setup import build_run, host_batch  # noqa: E402
from tests.reference.static_decoder import StaticGenerator  # noqa: E402


def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class _Template:
    """Stop ids nobody samples on purpose, and raw decoding: responses run to max_new_tokens."""

    stop_ids = (-1,)

    def __init__(self):
        self.tok = ByteTokenizer()

    def answer_text(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if 0 <= i < 256])


class StaticSampler(Sampler):
    """The rollout sampler with the static dense-cache decoder in place of the engine."""

    def __call__(self, params, prompts, rng, sampling=None):
        gen = StaticGenerator(
            self.model,
            params,
            sampling or self.sampling,
            eos_id=self.eos_id,
            max_len=self.seq_len,
            mesh=self.run.mesh,
            rules=self.run.rules,
        )
        return gen(prompts, rng=rng, pad_to=self.seq_len - gen.sampling.max_new_tokens)


def make_config(args):
    seq = args.prompt_len + args.max_new_tokens
    overrides = [
        f"data.seq_len={seq}",
        f"model.compute_dtype={args.dtype}",
        "mesh.data=1",
        f"rl.prompts_per_step={args.prompts}",
        f"rl.group_size={args.group}",
        f"rl.max_new_tokens={args.max_new_tokens}",
        f"rl.epochs={args.epochs}",
        f"rl.minibatches={args.minibatches}",
        f"rl.beta={args.beta}",
        "train.steps=1000",
        "optim.warmup_steps=0",
    ]
    if args.n_layers:
        overrides.append(f"model.n_layers={args.n_layers}")
    return load_config(args.config, overrides)


def main(args) -> dict:
    c = make_config(args)
    devices = jax.devices()[:1]
    run = build_rl_run(c, devices=devices)
    base = jax.device_get(build_run(c, devices=devices).init_state(seed=1).params)
    state, frozen = run.init(seed=0, base=base)
    rng = np.random.default_rng(0)
    vocab = min(c.model.vocab_size, 256)
    ids = rng.integers(1, vocab, (args.prompts, args.prompt_len)).astype(np.int32)
    prompts = PromptSet(
        "random",
        ids,
        np.full(args.prompts, args.prompt_len, np.int32),
        ["-"] * args.prompts,
        [[{"role": "user", "content": "-"}]] * args.prompts,
        [{}] * args.prompts,
        {},
    )
    settings = RlSettings.from_config(c.rl)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    template = _Template()
    sampler = Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    scorer = Scorer(run, False)
    step = RlStep(
        run, frozen, prompts, Rewards([RewardFn("digits", digit_share, 1.0)]), sampler, scorer, template, settings, c.rl
    )
    static_step = RlStep(
        run,
        frozen,
        prompts,
        Rewards([RewardFn("digits", digit_share, 1.0)]),
        StaticSampler(run, sampling, template.stop_ids, c.data.seq_len),
        scorer,
        template,
        settings,
        c.rl,
    )
    static_state = jax.tree.map(lambda x: x.copy(), state)  # each step donates its own state
    batch = {"index": np.arange(args.prompts, dtype=np.int32)}
    # peers: the bare sampler on the same prompts, a pretraining step on rows of the same shape
    prompt_rows = [ids[i].tolist() for i in range(args.prompts) for _ in range(args.group)]
    generator = Generator(
        sampler.model, sampler.params(state.params, frozen), sampling, eos_id=-1, max_len=c.data.seq_len
    )
    plain = build_run(c, devices=devices)
    plain_state = plain.init_state(seed=2)
    plain_sig = plain.signature(step.signature["inputs"].shape[0])
    plain_step = plain.train_step(plain_sig)
    plain_batch = plain.placer(plain_sig)(host_batch(plain_sig, seed=0, vocab_size=vocab))

    def rl_round():
        nonlocal state
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(state)
        return m | {"step_s": time.perf_counter() - t0}

    def static_round():
        nonlocal static_state
        t0 = time.perf_counter()
        static_state, m = static_step(static_state, batch)
        jax.block_until_ready(static_state)
        return {
            "static_step_s": time.perf_counter() - t0,
            "static_sampling_share": m["sampling_share"],
            "static_rollout_tokens_per_s": m["rollout_tokens_per_s"],
        }

    def sampler_round():
        t0 = time.perf_counter()
        out = generator(prompt_rows, rng=jax.random.PRNGKey(1))
        return sum(len(x) for x in out.ids) / (time.perf_counter() - t0)

    def pretrain_round():
        nonlocal plain_state
        t0 = time.perf_counter()
        for _ in range(args.epochs * args.minibatches):
            plain_state, m = plain_step(plain_state, plain_batch)
        jax.block_until_ready(m)
        return args.epochs * args.minibatches * plain_sig["inputs"].size / (time.perf_counter() - t0)

    rl_round(), static_round(), sampler_round(), pretrain_round()  # compile everything
    rows = []
    for r in range(args.rounds):
        m = rl_round()
        rows.append(
            {
                "step_s": m["step_s"],
                "rollout_tokens_per_s": m["rollout_tokens_per_s"],
                "update_tokens_per_s": m["update_tokens_per_s"],
                "sampling_share": m["sampling_share"],
                **static_round(),
                "sampler_tokens_per_s": sampler_round(),
                "pretrain_tokens_per_s": pretrain_round(),
            }
        )
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:,.3f}" for k, v in rows[-1].items()), flush=True)
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    med["rollout_over_sampler"] = statistics.median(x["rollout_tokens_per_s"] / x["sampler_tokens_per_s"] for x in rows)
    med["static_step_over_step"] = statistics.median(x["static_step_s"] / x["step_s"] for x in rows)
    med["update_over_pretrain"] = statistics.median(x["update_tokens_per_s"] / x["pretrain_tokens_per_s"] for x in rows)
    shape = {
        "params": sum(x.size for x in jax.tree.leaves(base)),
        "rows": args.prompts * args.group,
        "seq_len": c.data.seq_len,
        "updates_per_step": args.epochs * args.minibatches,
        "beta": args.beta,
    }
    print(json.dumps({"shape": shape, "median": med}, indent=2))
    return {"shape": shape, "rounds": rows, "median": med}


if __name__ == "__main__":
    figures = main(ARGS)
    if ARGS.out:
        pathlib.Path(ARGS.out).write_text(json.dumps(figures, indent=2))
