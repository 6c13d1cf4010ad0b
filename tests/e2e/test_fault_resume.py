"""`lm train` killed and resumed as a real process: SIGKILL at a step, SIGKILL during an async
save, SIGTERM (clean stop, exit 0, resume hint); the resumed run ends bitwise equal to an
uninterrupted one, with the same losses at every step."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import xla_flags
from tests.e2e.test_cli_train import SMALL

STEPS = 24
ARGS = SMALL + [
    f"--config.train.steps={STEPS}",
    "--config.train.log_every=1",
    "--config.eval.every_steps=0",
    "--config.checkpoint.every_steps=4",
    "--config.checkpoint.keep=2",
    "--config.train.sample_tokens=0",  # no closing sample: not what this test checks
]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def command(workdir, corpus, resume=False):
    return [
        sys.executable,
        "-m",
        "lm.cli",
        "train",
        "--workdir",
        str(workdir),
        f"--config.data.corpus={corpus}",
        *ARGS,
        *(["--resume"] if resume else []),
    ]


def start(workdir, corpus, resume=False):
    env = os.environ | {"XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        command(workdir, corpus, resume), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def logged_step(workdir) -> int:
    path = pathlib.Path(workdir, "metrics.jsonl")
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return max((r["step"] for r in rows if "loss" in r), default=0)


def saving(workdir) -> bool:
    ckpt = pathlib.Path(workdir, "checkpoints")
    return ckpt.is_dir() and any("tmp" in name for name in os.listdir(ckpt))


def wait_for(proc, condition, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before the kill point: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the kill point"
        time.sleep(0.002)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def final_state(workdir):
    manager = ocp.CheckpointManager(pathlib.Path(workdir, "checkpoints").absolute(), item_names=("state",))
    return manager.restore(STEPS, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def losses(workdir) -> dict:
    rows = [json.loads(line) for line in pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), "a resumed run must not leave duplicate rows"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


@pytest.mark.slow
def test_killed_and_stopped_runs_resume_exactly(tmp_path, corpus):
    ref, run = tmp_path / "ref", tmp_path / "run"
    reference = start(ref, corpus)

    first = start(run, corpus)  # SIGKILL between checkpoints 4 and 8
    wait_for(first, lambda: logged_step(run) >= 6 and (run / "checkpoints" / "4").is_dir())
    first.send_signal(signal.SIGKILL)
    assert finish(first)[0] == -signal.SIGKILL

    second = start(run, corpus, resume=True)  # SIGKILL while an async save is being written
    wait_for(second, lambda: logged_step(run) >= 9 and saving(run))
    second.send_signal(signal.SIGKILL)
    assert finish(second)[0] == -signal.SIGKILL
    assert saving(run)  # the half-written step is still a temporary directory

    third = start(run, corpus, resume=True)  # SIGTERM: finish the step, save, exit 0
    wait_for(third, lambda: logged_step(run) >= 14)
    third.send_signal(signal.SIGTERM)
    code, _, err = finish(third)
    assert code == 0, err[-2000:]
    assert "lm: stopped by SIGTERM at step" in err and "--resume" in err.splitlines()[-1]
    stop_step = int(err.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert stop_step >= 14 and (run / "checkpoints" / str(stop_step)).is_dir()

    code, _, err = finish(start(run, corpus, resume=True))
    assert code == 0, err[-2000:]
    assert finish(reference)[0] == 0
    assert not saving(run)  # the leftover temporary directory was cleaned up

    a, b = final_state(ref), final_state(run)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert losses(run) == losses(ref) and len(losses(ref)) == STEPS


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step(tmp_path, corpus):
    """Two processes x 4 devices; only process 1 gets SIGTERM: both agree on the stop step."""
    from tests.e2e.test_distributed import free_port

    env = os.environ | {"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    port = free_port()
    base = command(tmp_path / "w", corpus) + [
        "--config.mesh.data=2",
        "--config.mesh.fsdp=4",
        "--config.train.steps=100000",
        "--config.checkpoint.agree_every_steps=3",
    ]
    procs = [
        subprocess.Popen(
            base
            + ["--distributed", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    wait_for(procs[0], lambda: logged_step(tmp_path / "w") >= 5)
    procs[1].send_signal(signal.SIGTERM)
    results = [finish(p) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-2000:]
    stops = [int(err.split("at step ")[1].split(";")[0]) for _, _, err in results]
    assert stops[0] == stops[1] and stops[0] % 3 == 0  # agreed at an agreement step
    assert "SIGTERM" in results[1][2] and "a signal on another process" in results[0][2]
    assert (tmp_path / "w" / "checkpoints" / str(stops[0])).is_dir()
