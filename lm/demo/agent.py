"""`lm demo`'s tool-use stage: multi-digit multiplication (lm.data.arithmetic), which the tiny model
cannot do in its head but can do with a calculator.

The pretrained model is fine-tuned on a mix of conversations with the calculator offered (call,
result, answer) and without tools (a direct answer), then trained with GRPO through the
calculator environment (`ArithmeticTool`: the task's short tool listing, so that an episode fits
the tiny model's 256 positions). Held-out exact match, with a 95% bootstrap interval over the
prompts, is measured three ways by greedy episodes through the same environment: the SFT model
without tools offered, the SFT model with the calculator, and the GRPO model with it.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from lm.data.arithmetic import TOOL, write_arithmetic_task
from lm.data.chat import ChatTemplate
from lm.data.jsonl import ONE_OBJECT, iter_jsonl
from lm.eval.answers import plain_model
from lm.infer.engine.engine import Engine, EngineConfig
from lm.infer.sampling import SamplingParams
from lm.store.load import load_trained
from lm.store.meta import init_config
from lm.train.environments import Tool, ToolUse, calculate
from lm.train.episodes import EpisodeRunner, Limits
from lm.train.finetune import finetune_config
from lm.train.metrics import read_metrics
from lm.train.rl import rl
from lm.train.sft import sft

SFT_CONFIG, RL_CONFIG = "configs/sft_tiny.py", "configs/agent_tiny.py"
SORT_RL_CONFIG = "configs/rl_tiny.py"  # the demo's GRPO run (stage 7), beside its asynchronous variants
STALENESS = (0, 1, 2)
QUESTION = "What is 347 * 29?"
SFT = ["data.seq_len=256", "finetune.eval_examples=16", "finetune.eval_max_new_tokens=8"]
BOOTSTRAP, LEVEL = 1000, 0.95


def exact_answer(example: dict, text: str) -> dict:
    """Reward `correct`: 1 when the final answer is the product, whitespace aside."""
    return {"correct": float(text.strip() == str(example["answer"]).strip())}


def calc(x: str) -> str:
    """lm.train.environments.calculate under the task's short names (lm.data.arithmetic.TOOL)."""
    return calculate(x)


class ArithmeticTool(ToolUse):
    """The calculator listed as the task's data lists it (lm.data.arithmetic.TOOL), scored by the
    exact answer."""

    def __init__(self):
        f = TOOL["function"]
        super().__init__([Tool(calc, f["name"], f["description"], f["parameters"])], exact_answer)


class NoTool(ToolUse):
    """The same questions and score with no tools offered: the model must answer directly."""

    def __init__(self):
        super().__init__([], exact_answer)


def bootstrap_interval(values, rounds: int = BOOTSTRAP, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (one per held-out prompt)."""
    x = np.asarray(values, np.float64)
    means = x[np.random.default_rng(seed).integers(0, len(x), (rounds, len(x)))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def scored(values) -> dict:
    """{'mean', 'ci95', 'n'} of per-prompt scores."""
    values = [float(v) for v in values]
    return {"mean": float(np.mean(values)), "ci95": list(bootstrap_interval(values)), "n": len(values)}


def read_examples(path) -> list[dict]:
    return [row for _, row in iter_jsonl(path, lambda row: row, expected=ONE_OBJECT)]


def greedy_episodes(
    workdir, make_env, examples: list[dict], max_new_tokens: int = 48, turns: int = 3, batch: int = 128
) -> dict:
    """Greedy episodes of a run's newest model through `make_env` (lm.train.episodes, as RL runs
    them): per example its reward, turns and tool calls, and how each episode ended."""
    loaded = load_trained(workdir=str(workdir))
    built, params = plain_model(loaded.config, loaded.params)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    max_len = loaded.config.model.max_seq_len
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    out = {"reward": [], "tool_calls": [], "end": []}
    for s in range(0, len(examples), batch):
        chunk = examples[s : s + batch]
        engine = Engine(
            built.module, max_len=max_len, config=EngineConfig(slots=len(chunk)), mesh=built.mesh, rules=built.rules
        )
        runner = EpisodeRunner(engine, template, sampling, Limits(turns=turns))
        for ep in runner(params, make_env, chunk, jax.random.PRNGKey(0)):
            out["reward"].append(ep.reward)
            out["tool_calls"].append(ep.tool_calls)
            out["end"].append(ep.end)
    return out


def tool_use(stages, root: pathlib.Path, base_dir: pathlib.Path, sft_overrides=(), rl_overrides=(), **sizes) -> dict:
    """The task written, SFT from the pretrained model, GRPO through the calculator; held-out exact
    match of the SFT model without and with the tool and of the GRPO model with it (and GRPO's
    sampled reward over its first and last 5 steps). `sizes`: write_arithmetic_task's counts."""
    paths = write_arithmetic_task(root / "task", **sizes)
    base = str(pathlib.Path(base_dir).absolute())
    config = finetune_config(
        init_config(base),
        SFT_CONFIG,
        [*SFT, *sft_overrides],
        init=base,
        data=str(paths["sft"]),
        eval_data=str(paths["sft_heldout"]),
    )
    tuned = stages.train(sft, config, root / "sft")
    sft_dir = str((root / "sft").absolute())
    config = finetune_config(
        init_config(sft_dir),
        RL_CONFIG,
        list(rl_overrides),
        "rl",
        init=sft_dir,
        data=str(paths["prompts"]),
        eval_data=str(paths["heldout"]),
    )
    grpo = stages.train(rl, config, root / "grpo")
    heldout = read_examples(paths["heldout"])
    runs = {"sft, no tool": (root / "sft", NoTool), "sft, calculator": (root / "sft", ArithmeticTool)}
    runs["grpo, calculator"] = (root / "grpo", ArithmeticTool)
    out = {"steps": {"sft": tuned.get("step"), "grpo": grpo.get("step")}, "n": len(heldout), "conditions": {}}
    for name, (workdir, env) in runs.items():
        done = greedy_episodes(workdir, env, heldout)
        out["conditions"][name] = scored(done["reward"]) | {"tool_calls": float(np.mean(done["tool_calls"]))}
    rewards = [r["reward"] for r in read_metrics(root / "grpo" / "metrics.jsonl") if "reward" in r]
    out["rollout_reward"] = [float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))] if rewards else None
    out["plot"] = str(root / "grpo" / "rl.png")
    print("\n".join(tool_use_lines(out)))
    return out


def tool_use_lines(s: dict) -> list[str]:
    """The evidence table's lines for the tool-use runs."""
    lines = [
        f"tool use: '{QUESTION}' (3 x 2 digits), {s['n']} held-out prompts, greedy episodes, exact match "
        f"[95% bootstrap interval] (SFT {s['steps']['sft']} steps, GRPO {s['steps']['grpo']} steps):"
    ]
    for name, c in s["conditions"].items():
        lo, hi = c["ci95"]
        lines.append(
            f"  {name:<18} {c['mean']:>7.1%} [{lo:.1%}, {hi:.1%}]   {c['tool_calls']:.2f} tool calls per episode"
        )
    if s.get("rollout_reward"):
        first, last = s["rollout_reward"]
        lines.append(
            f"  GRPO's sampled episodes (temperature 1): reward {first:.3f} over its first 5 steps, {last:.3f} over "
            f"its last 5; curves: {s['plot']}"
        )
    return lines


def staleness_runs(stages, root: pathlib.Path, paths: dict, sft_dir, rl_overrides=(), sync_dir=None) -> dict:
    """GRPO on the sort task (stage 7's config) with rl.max_staleness k = 0, 1, 2 from the SFT
    model `sft_dir`; `sync_dir`: stage 7's own run, the k = 0 run when given (the same settings).
    Per run: steps per second, the learner's share of time waiting for rollouts, the held-out
    reward curve, and the final held-out exact match with its bootstrap interval."""
    sft_dir = str(pathlib.Path(sft_dir).absolute())
    runs = {}
    for k in STALENESS:
        runs[k] = pathlib.Path(sync_dir) if k == 0 and sync_dir is not None else root / f"grpo-k{k}"
        if runs[k] != sync_dir:
            config = finetune_config(
                init_config(sft_dir),
                SORT_RL_CONFIG,
                [*rl_overrides, f"rl.max_staleness={k}"],
                "rl",
                init=sft_dir,
                data=str(paths["train"]),
                eval_data=str(paths["heldout"]),
            )
            stages.train(rl, config, runs[k])
    heldout = [
        {"prompt": r["messages"][0]["content"], "answer": r["messages"][1]["content"]}
        for r in read_examples(paths["heldout"])
    ]
    out = {"runs": {}, "plot": str(root / "grpo_staleness.png")}
    for k, workdir in runs.items():
        rows = read_metrics(workdir / "metrics.jsonl")
        config = json.loads((workdir / "config.json").read_text())
        done = greedy_episodes(workdir, NoTool, heldout, max_new_tokens=config["rl"]["max_new_tokens"], turns=1)
        out["runs"][str(k)] = run_figures(rows, config["train"]["batch_size"] * config["data"]["seq_len"]) | {
            "workdir": str(workdir),
            "final": scored(done["reward"]),
        }
    lo, hi = out["runs"]["0"]["final"]["ci95"]
    for r in out["runs"].values():
        r["inside_sync_interval"] = lo <= r["final"]["mean"] <= hi
    plot_staleness(out["runs"], root / "grpo_staleness.png")
    print("\n".join(staleness_lines(out)))
    return out


def run_figures(rows: list[dict], tokens_per_step: int) -> dict:
    """Steps per second over the timed steps (the loop's windows: evals and checkpoints left out),
    the mean wait share and sampling share, and the held-out reward curve."""
    rates = [r["tokens_per_s"] / tokens_per_step for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    mean = lambda key: (
        float(np.mean(v)) if (v := [r[key] for r in rows if isinstance(r.get(key), (int, float))]) else None
    )  # noqa: E731
    return {
        "steps_per_s": len(rates) / sum(1 / x for x in rates) if rates else None,
        "wait_share": mean("rollout_wait_share"),
        "sampling_share": mean("sampling_share"),
        "curve": [[r["step"], r["eval_reward"]] for r in rows if isinstance(r.get("eval_reward"), (int, float))],
    }


def plot_staleness(runs: dict, out_path: pathlib.Path) -> None:
    """The held-out reward curves of the runs in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, r in runs.items():
        steps, rewards = zip(*r["curve"]) if r["curve"] else ((), ())
        label = "synchronous (k = 0)" if k == "0" else f"asynchronous, rl.max_staleness = {k}"
        ax.plot(steps, rewards, marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy reward (exact answer)")
    ax.set_title("GRPO on the sort task: synchronous vs asynchronous rollouts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def staleness_lines(s: dict) -> list[str]:
    """The evidence table's lines for the asynchronous GRPO runs."""
    nan = float("nan")
    lines = [
        "asynchronous GRPO (the sort task as stage 7; rollouts of step s + k sampled by the params of step s;",
        "  on 2 CPU cores sampling and updates share the cores, so no speed-up is expected here):",
        f"  {'k':<3} {'steps/s':>8} {'learner waiting':>16} {'held-out exact match [95% CI]':>31}  inside k = 0's",
    ]
    for k, r in s["runs"].items():
        f, (lo, hi) = r["final"], r["final"]["ci95"]
        wait = (
            f"{r['wait_share']:.0%}" if r["wait_share"] is not None else f"({r['sampling_share'] or nan:.0%} sampling)"
        )
        inside = "-" if k == "0" else ("yes" if r["inside_sync_interval"] else "no")
        lines.append(
            f"  {k:<3} {r['steps_per_s'] or nan:>8.3f} {wait:>16} {f['mean']:>14.1%} [{lo:.1%}, {hi:.1%}]  {inside:>13}"
        )
    return lines + [f"  curves: {s['plot']}"]
