"""A lost process of a multi-host run (two processes x 4 devices on localhost) ends the other one
with one `lm:` line naming it, the last step and the checkpoint to resume from (exit 75), and
`--resume` on both ends exactly like an uninterrupted run; a process lost while joining is named."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from lm.process import peers
from tests.conftest import xla_flags
from tests.e2e.test_cli_train import SMALL
from tests.e2e.test_distributed import free_port
from tests.e2e.test_fault_resume import ROOT, logged_step, losses, wait_for

STEPS = 24
PEER_S = 10
ARGS = SMALL + [
    f"--config.train.steps={STEPS}",
    "--config.train.log_every=1",
    "--config.eval.every_steps=0",
    "--config.checkpoint.every_steps=4",
    "--config.train.sample_tokens=0",  # no closing sample: not what this test checks
    "--config.mesh.data=2",
    "--config.mesh.fsdp=4",
    "--peer-timeout",
    str(PEER_S),
]
SLACK_S = 300  # on top of the bound: a slow, loaded machine must pass
LOST = re.compile(
    r"lm: lost process (\d) of 2(?: \(the coordinator\))?: (?:silent|no answer) for (\d+) s "
    rf"\(--peer-timeout {PEER_S}\); this process \((\d)\) completed step (\d+); resume from checkpoint "
    r"step (\d+): run the same command on every process with --resume$"
)


def launch(workdir, corpus, *extra: str, args=ARGS) -> tuple[list[subprocess.Popen], int]:
    env = os.environ | {"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    port = free_port()
    base = [
        sys.executable,
        "-m",
        "lm.cli",
        "train",
        "--workdir",
        str(workdir),
        f"--config.data.corpus={corpus}",
        *args,
        *extra,
        "--distributed",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
    ]
    return [
        subprocess.Popen(
            base + ["--process-id", str(i)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ], port


def ended(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def last_line(err: str) -> str:
    """The last stderr line of a process that ended itself: no traceback or C++ stack came before it."""
    for mark in ("Traceback", "Check failure", "terminate called", "*** "):
        assert mark not in err, err[-3000:]
    return [line for line in err.splitlines() if line.strip()][-1]


def kill_and_check(procs, lost: int, workdir) -> tuple[int, str]:
    """Kills process `lost`; the other one ends within the bound with one line. Returns the step that
    line advises to resume from, and what the survivor printed on stdout."""
    procs[lost].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code, out, err = ended(procs[1 - lost])
    assert time.monotonic() - killed < PEER_S + SLACK_S
    assert ended(procs[lost])[0] == -signal.SIGKILL
    assert code == 75 and err.count("lm: lost") == 1, err[-3000:]
    found = LOST.match(last_line(err))
    assert found, err[-3000:]
    who, silent, me, step, saved = map(int, found.groups())
    assert (who, me) == (lost, 1 - lost) and silent >= PEER_S and step >= saved
    assert (workdir / "checkpoints" / str(saved)).is_dir()
    return saved, out


@pytest.mark.slow
def test_a_lost_process_ends_the_other_with_one_line_and_both_resume_exactly(tmp_path, corpus):
    ref, run = tmp_path / "ref", tmp_path / "run"
    reference, _ = launch(ref, corpus)

    first, _ = launch(run, corpus)  # process 1 lost: process 0 names it
    wait_for(first[0], lambda: logged_step(run) >= 6 and (run / "checkpoints" / "4").is_dir())
    saved, _ = kill_and_check(first, 1, run)

    second, _ = launch(run, corpus, "--resume")  # process 0, the coordinator, lost: process 1 names it
    wait_for(second[1], lambda: logged_step(run) >= 14 and (run / "checkpoints" / "12").is_dir())
    saved_again, out = kill_and_check(second, 0, run)
    assert f"resumed from step {saved}" in out  # the advice of the first line was what --resume did

    third, _ = launch(run, corpus, "--resume")
    for proc in third + reference:
        code, out, err = ended(proc)
        assert code == 0 and "lm: lost" not in err, err[-3000:]
        assert proc not in third or f"resumed from step {saved_again}" in out
    assert losses(run) == losses(ref) and len(losses(ref)) == STEPS


@pytest.mark.slow
def test_a_process_lost_while_joining_is_named(tmp_path, corpus):
    runs = {lost: launch(tmp_path / str(lost), corpus, "--startup-timeout", "10") for lost in (0, 1)}
    for lost, (procs, _) in runs.items():
        procs[lost].send_signal(signal.SIGKILL)
    for lost, (procs, port) in runs.items():
        code, _, err = ended(procs[1 - lost])
        assert code == 75, err[-3000:]
        if lost == 1:
            assert last_line(err) == (
                "lm: process 1 of 2 did not join within 10 s (--startup-timeout); start every process with the "
                f"same command and its own --process-id, and check that each one reaches 127.0.0.1:{port}"
            )
        else:
            assert last_line(err) == (
                f"lm: process 0 (the coordinator at 127.0.0.1:{port}) did not answer within 10 s "
                "(--startup-timeout); start it (the same command with --process-id 0), or check --coordinator"
            )


def test_the_line_says_what_was_reached_and_how_to_go_on(monkeypatch, tmp_path):
    progress = peers.Progress()
    monkeypatch.setattr(peers, "PROGRESS", progress)
    fresh, resumed = (peers.Launch(300, 10, resumable=True, resumed=r) for r in (False, True))
    head = "lm: lost process 1 of 2: silent for 12 s (--peer-timeout 10); this process (0) "
    assert peers._line(1, 12.3, 0, 2, fresh) == head + (
        "had not begun training; no checkpoint yet: run the same command again on every process (without --resume)"
    )
    assert peers._line(1, 12.3, 0, 2, resumed) == head + (
        "had not resumed training; resume from the newest checkpoint: run the same command again on every process "
        "(with --resume)"
    )
    progress.started(4, tmp_path)  # resumed from step 4; the save of step 8 never finished
    progress.saving_started(8)
    progress.step = 9
    advice = "resume from checkpoint step {}: run the same command on every process with --resume"
    assert peers._line(1, 12, 0, 2, resumed) == head + "completed step 9; " + advice.format(4)
    (tmp_path / "8").mkdir()
    assert peers._line(0, 12, 2, 3, resumed) == (
        "lm: lost process 0 of 3 (the coordinator): no answer for 12 s "
        "(--peer-timeout 10); this process (2) completed step 9; " + advice.format(8)
    )
    other = peers.Launch(300, 10, resumable=False, resumed=False)
    assert peers._line(1, 12, 0, 2, other).endswith(
        "silent for 12 s (--peer-timeout 10); this process (0) completed "
        "step 9; run the same command again on every process"
    )


def test_the_relay_keeps_a_connection_open_and_silent_once_the_coordinator_closed_it():
    coordinator = socket.create_server(("127.0.0.1", 0))
    relay = peers._Relay(f"127.0.0.1:{coordinator.getsockname()[1]}")
    client = socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=10)
    upstream, _ = coordinator.accept()
    client.sendall(b"ping")
    assert upstream.recv(4) == b"ping"
    upstream.sendall(b"pong")
    assert client.recv(4) == b"pong" and relay.reached and not relay.lost
    upstream.close()  # the coordinator is gone: no end of stream reaches the client
    client.settimeout(1)
    with pytest.raises(socket.timeout):
        client.recv(1)
    client.sendall(b"dropped")
    assert relay.lost
    coordinator.close()  # not listening: a new connection is closed, and the client retries
    again = socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=10)
    assert again.recv(1) == b""


def test_a_cluster_s_coordinator_and_index_are_found_before_jax_looks(monkeypatch):
    """--distributed alone on Slurm: the relay needs the coordinator and the index JAX would detect."""
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    for key, value in dict(
        SLURM_JOB_ID="4096", SLURM_STEP_NODELIST="node[7-8]", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0"
    ).items():
        monkeypatch.setenv(key, value)
    address, n, me = peers._detected(None, None, None, 10)
    assert address.startswith("node7:") and (n, me) == (2, 1)
    assert peers._detected("h:1", 3, 0, 10) == ("h:1", 3, 0)
