"""Several processes train like one process with all the devices (jax.distributed on localhost)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import xla_flags
from tests.e2e.test_cli_train import SMALL

ARGS = SMALL + [
    "--config.train.steps=6",
    "--config.train.log_every=2",
    "--config.eval.every_steps=0",
    "--config.checkpoint.every_steps=3",
    "--config.train.sample_tokens=0",  # no closing sample: not what this test checks
    "--config.mesh.data=2",
    "--config.mesh.fsdp=4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(workdir, corpus, n_proc: int, devices_per_proc: int, args=ARGS):
    env = os.environ | {"XLA_FLAGS": xla_flags(devices_per_proc), "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "lm.cli", "train", "--workdir", str(workdir), f"--config.data.corpus={corpus}", *args]
    if n_proc > 1:
        port = free_port()
        cmds = [
            base
            + [
                "--distributed",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(n_proc),
                "--process-id",
                str(i),
            ]
            for i in range(n_proc)
        ]
    else:
        cmds = [base]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, corpus):
    one = run(tmp_path / "one", corpus, 1, 8)
    two = run(tmp_path / "two", corpus, 2, 4)
    losses_one = [r["loss"] for r in one if "loss" in r]
    losses_two = [r["loss"] for r in two if "loss" in r]
    assert len(losses_one) == 3
    assert losses_two == pytest.approx(losses_one, rel=1e-5)
    evals_one = [(r["eval_loss"], r["eval_tokens"]) for r in one if "eval_loss" in r]
    evals_two = [(r["eval_loss"], r["eval_tokens"]) for r in two if "eval_loss" in r]
    assert [t for _, t in evals_two] == [t for _, t in evals_one]
    assert [v for v, _ in evals_two] == pytest.approx([v for v, _ in evals_one], rel=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "6").is_dir()
    assert not (tmp_path / "two" / "sample.txt").exists()  # train.sample_tokens=0: no closing sample


# tensor=2 spans processes: processes 0 and 1 hold the same batch shard (and 2 and 3 the other),
# so each pair must feed identical rows.
TENSOR_ARGS = SMALL + [
    "--config.train.steps=4",
    "--config.train.log_every=1",
    "--config.eval.every_steps=0",
    "--config.checkpoint.every_steps=4",
    "--config.mesh.data=1",
    "--config.train.sample_tokens=0",  # no closing sample: not what this test checks
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.model.n_kv_heads=2",
    "--config.train.batch_size=8",
]


# context=2 (the ring) spans processes the same way: each pair splits one batch shard's sequences
CONTEXT_ARGS = [a for a in TENSOR_ARGS if a != "--config.mesh.tensor=2"] + [
    "--config.mesh.context=2",
    "--config.model.context_attention=ring",
]


@pytest.mark.slow
@pytest.mark.parametrize("args", [TENSOR_ARGS, CONTEXT_ARGS], ids=["tensor", "context"])
def test_four_processes_with_an_axis_across_processes_match_one(tmp_path, corpus, args):
    one = run(tmp_path / "one", corpus, 1, 4, args)
    four = run(tmp_path / "four", corpus, 4, 1, args)
    losses_one = [r["loss"] for r in one if "loss" in r]
    losses_four = [r["loss"] for r in four if "loss" in r]
    assert len(losses_one) == 4
    assert losses_four == pytest.approx(losses_one, rel=1e-5)
    tokens = [r["tokens"] for r in one if "tokens" in r]
    assert [r["tokens"] for r in four if "tokens" in r] == tokens
