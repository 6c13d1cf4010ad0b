"""`lm rl` (its rollouts sampled one step ahead), `lm eval` and `lm sample` in 2 processes x 4
devices give what 1 process x 8 devices gives (jax.distributed on localhost). One driver process
per process runs the three verbs in turn, so jax starts once per process."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from lm.data.synthetic import write_sort_task
from lm.store.checkpoint_read import read_checkpoint_params
from tests.conftest import xla_flags
from tests.e2e.test_cli_rl import COMMON
from tests.e2e.test_distributed import free_port

# overlap (as in test_cli_rl) that also notes which process called it
REWARD = """
import os, pathlib

def overlap(prompts, completions, answer, **columns):
    calls = pathlib.Path(__file__).parent / "calls" / str(os.getpid())
    calls.parent.mkdir(exist_ok=True)
    calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
    return [sum(ch in a for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]
"""
DRIVER = """
import json, sys
from lm.cli import main
for verb in json.loads(sys.argv[1]):
    if main(verb + sys.argv[2:]) != 0:
        sys.exit(1)
"""


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    task = write_sort_task(root, 16, 4)
    mc = write(
        root / "mc.jsonl",
        [{"context": f"def f{i}(x):", "choices": ["\n    return x", "\n\n\n"], "answer": 0} for i in range(6)],
    )
    gen = write(root / "gen.jsonl", [{"prompt": "import o", "answer": "s"}, {"prompt": "def", "answer": " f"}])
    held = write(root / "held.jsonl", [{"text": "def add(a, b):\n    return a + b\n"}] * 3)
    prompts = write(root / "prompts.jsonl", [{"prompt": p} for p in ("def f(", "import", "x = ")])
    return task | {"mc": mc, "gen": gen, "held": held, "prompts": prompts}


def start(base, inputs, out, n_proc: int) -> list:
    """lm rl (two GRPO steps of two updates, rl.max_staleness=1), lm eval (three task kinds) and lm sample in `n_proc`
    processes of 8 // n_proc devices each."""
    out.mkdir()
    (out / "rewards.py").write_text(REWARD)
    rl = [
        "rl",
        "--init",
        str(base),
        "--data",
        str(inputs["train"]),
        "--eval-data",
        str(inputs["heldout"]),
        "--rewards",
        f"{out / 'rewards.py'}:overlap",
        "--workdir",
        str(out / "rl"),
        "--config.train.steps=2",
        "--config.optim.warmup_steps=0",
        "--config.rl.max_staleness=1",
        *COMMON,
    ]  # no warmup: the updates move the params; step 1 trains on rollouts sampled ahead by step 0's params
    evaluate = [
        "eval",
        "--workdir",
        str(base),
        "--no-progress",
        "--batch-size",
        "8",
        "--out",
        str(out / "eval.json"),
        "--tasks",
        f"held={inputs['held']}",
        f"mc={inputs['mc']}?shots=2",
        f"gen={inputs['gen']}?chat=false&max_new_tokens=4&scorer=normalized",
    ]
    sample = [
        "sample",
        "--workdir",
        str(base),
        "--prompts",
        str(inputs["prompts"]),
        "--out",
        str(out / "sample.jsonl"),
        "--max-new-tokens",
        "6",
        "--temperature",
        "1",
        "--seed",
        "3",
    ]
    verbs = json.dumps([rl, evaluate, sample])
    env = os.environ | {"XLA_FLAGS": xla_flags(8 // n_proc), "JAX_PLATFORMS": "cpu"}
    port = free_port()
    flags = (
        [
            ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n_proc), "--process-id", str(i)]
            for i in range(n_proc)
        ]
        if n_proc > 1
        else [[]]
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, verbs, *f],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for f in flags
    ]


def results(out, procs: list):
    """(RL metrics rows, the eval report, the sample lines, each process's output) once `procs` end."""
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-3000:]
    metrics = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "sample.jsonl").read_text().splitlines()]
    return metrics, json.loads((out / "eval.json").read_text()), samples, outs


def numbers(row: dict) -> dict:
    """The metrics that follow from the computation (not timings)."""
    timed = ("_per_s", "sampling_share", "rollout_wait", "compile_s", "mfu", "peak_flops", "flops_per_token")
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not any(t in k for t in timed)}


@pytest.mark.slow
def test_rl_eval_and_sample_in_two_processes_match_one(small_base, inputs, tmp_path):
    runs = {n: start(small_base, inputs, tmp_path / str(n), n) for n in (1, 2)}  # side by side
    one, two = (results(tmp_path / str(n), procs) for n, procs in runs.items())
    # RL: the same rollouts, rewards, updates and held-out greedy rewards, logged once
    rows_one, rows_two = [numbers(r) for r in one[0]], [numbers(r) for r in two[0]]
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one]
    assert [r.keys() for r in rows_two] == [r.keys() for r in rows_one]
    assert any("reward" in r for r in rows_one) and any("eval_reward" in r for r in rows_one)
    for a, b in zip(rows_one, rows_two):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    base, *tuned = (
        jax.tree.leaves(read_checkpoint_params(w)[0])
        for w in (small_base, tmp_path / "1" / "rl", tmp_path / "2" / "rl")
    )
    assert any(not np.array_equal(x, y) for x, y in zip(base, tuned[0]))
    for x, y in zip(*tuned):  # Adam's steps (lr 1e-3, sign-like) agree to a hundredth of a step
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "2" / "rl" / "summary.json").exists()
    assert len(list((tmp_path / "2" / "calls").iterdir())) == 1  # rewards computed by one process
    # eval: the same report, token counts and choices exactly
    tasks_one, tasks_two = one[1]["tasks"], two[1]["tasks"]
    assert tasks_two["held"]["metrics"] == pytest.approx(tasks_one["held"]["metrics"], rel=1e-5)
    assert tasks_two["held"]["per_example"]["tokens"] == tasks_one["held"]["per_example"]["tokens"]
    for k, v in tasks_one["mc"]["per_example"].items():
        assert tasks_two["mc"]["per_example"][k] == pytest.approx(v, rel=1e-5)
    assert tasks_two["gen"]["samples"] == tasks_one["gen"]["samples"]
    # sample: the same sampled tokens, written once
    assert [s["tokens"] for s in two[2]] == [s["tokens"] for s in one[2]]
    np.testing.assert_allclose(
        sum((s["logprobs"] for s in two[2]), []), sum((s["logprobs"] for s in one[2]), []), rtol=1e-5
    )
    assert two[3][1].count("bits_per_byte") == 0 and two[3][0].count("bits_per_byte") == 1  # one table
