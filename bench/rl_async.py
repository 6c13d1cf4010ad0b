"""Asynchronous RL rollouts (rl.max_staleness): step time of `lm rl`'s GRPO step sampling ahead
(k = 1: the rollouts of step s+1 sampled on a worker thread while step s updates) against the
synchronous step (k = 0), in the same rounds.

The step is bench/rl_step.py's (tiny config, random model, random prompts, responses to
--max-new-tokens, the digit-share reward) with the reward made slow by --reward-latency seconds
per rollout batch (a sleep: a reward service, a verifier or a tool environment on the host).
Each round runs --steps steps of a fresh run per k (k = 0 then 1, alternating) and reports the
seconds per step after the first (which compiles, or fills the pipeline), and for k = 1 the
seconds the update waited for its rollouts. Medians over rounds; prints figures, asserts nothing.

    .venv/bin/python bench/rl_async.py [--reward-latency 0.5] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import rl_step as base  # noqa: E402  (sets the XLA flags before jax)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward-latency", type=float, default=0.5, help="seconds each rollout batch's reward takes")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    known, rest = p.parse_known_args(argv)
    return known, base.parse_args(rest)


class Stream:
    def __init__(self, n: int):
        self.n, self.pos = n, 0

    def __next__(self):
        self.pos += 1
        return {"index": base.np.arange(self.n, dtype=base.np.int32)}

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def one_run(args, rl_args, k: int) -> tuple[float, float]:
    """(seconds per step after the first, seconds waited for rollouts per step) of a fresh run."""
    jax, np = base.jax, base.np
    c = base.load_config(rl_args.config, [*overrides(rl_args), f"rl.max_staleness={k}"])
    devices = jax.devices()[:1]
    run = base.build_rl_run(c, devices=devices)
    params = jax.device_get(base.build_run(c, devices=devices).init_state(seed=1).params)
    state, frozen = run.init(seed=0, base=params)
    ids = np.random.default_rng(0).integers(1, 256, (rl_args.prompts, rl_args.prompt_len)).astype(np.int32)
    prompts = base.PromptSet(
        "random",
        ids,
        np.full(rl_args.prompts, rl_args.prompt_len, np.int32),
        ["-"] * rl_args.prompts,
        [[{"role": "user", "content": "-"}]] * rl_args.prompts,
        [{}] * rl_args.prompts,
        {},
    )

    def slow_reward(prompts, completions, **columns):
        time.sleep(args.reward_latency)
        return base.digit_share(prompts, completions)

    settings = base.RlSettings.from_config(c.rl)
    sampling = base.SamplingParams(max_new_tokens=rl_args.max_new_tokens, temperature=1.0)
    template = base._Template()
    sampler = base.Sampler(run, sampling, template.stop_ids, c.data.seq_len)
    scorer = base.Scorer(run, False, with_policy=k > 0)
    rewards = base.Rewards([base.RewardFn("digits", slow_reward, 1.0)])
    step = base.RlStep(run, frozen, prompts, rewards, sampler, scorer, template, settings, c.rl)
    stream = step.stream(Stream(rl_args.prompts))
    times, waits = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, next(stream))
        jax.block_until_ready(state)
        if i:
            times.append(time.perf_counter() - t0)
            waits.append(m.get("rollout_wait_s", 0.0))
    return statistics.mean(times), statistics.mean(waits)


def overrides(a) -> list[str]:
    return [
        f"data.seq_len={a.prompt_len + a.max_new_tokens}",
        "mesh.data=1",
        f"rl.prompts_per_step={a.prompts}",
        f"rl.group_size={a.group}",
        f"rl.max_new_tokens={a.max_new_tokens}",
        f"rl.beta={a.beta}",
        "train.steps=1000",
        "optim.warmup_steps=0",
    ]


def main(argv=None) -> None:
    args, rl_args = parse_args(argv)
    print(
        f"GRPO step, {rl_args.prompts} prompts x {rl_args.group} samples, {rl_args.max_new_tokens} new tokens, "
        f"reward latency {args.reward_latency} s; {args.steps} steps a run, {args.rounds} rounds"
    )
    runs = {0: [], 1: []}
    for r in range(args.rounds):
        for k in (0, 1):
            runs[k].append(one_run(args, rl_args, k))
            print(f"round {r + 1} k={k}: {runs[k][-1][0]:.3f} s/step, waited {runs[k][-1][1]:.3f} s/step", flush=True)
    sync, stale = (statistics.median(t for t, _ in runs[k]) for k in (0, 1))
    wait = statistics.median(w for _, w in runs[1])
    print("| rl.max_staleness | s/step | steps/s | update waited for rollouts |")
    print("|---|---:|---:|---:|")
    print(f"| 0 (synchronous) | {sync:.3f} | {1 / sync:.2f} | (all of sampling) |")
    print(f"| 1 | {stale:.3f} | {1 / stale:.2f} | {wait:.3f} s/step |")
    print(f"async / sync step throughput: {sync / stale:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
