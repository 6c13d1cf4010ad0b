"""SIGINT/SIGTERM stop every verb cleanly, whatever phase they land in: `lm demo` as a whole (no later
stage starts; --resume goes on), `lm sample` while XLA compiles and while it decodes (one line, the
shell's code for the signal, no crash, --out untouched), and data preparation with curation (no
worker tracebacks; a SIGINT inherited as ignored never hangs the run; no worker left behind).

Each test runs the command in a subprocess and waits for the phase by watching its output, its
files or its processes; timeouts are only guards against a hang."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import xla_flags
from tests.e2e.test_cli_train import SLOW, SMALL

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUARD = 600  # seconds: only a hang takes this long


def env(devices: int = 8) -> dict:
    return os.environ | {"XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu"}


def wait_for(proc, condition, what: str) -> None:
    deadline = time.monotonic() + GUARD
    while not condition():
        assert proc.poll() is None, f"it ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def logged_step(workdir) -> int:
    path = pathlib.Path(workdir, "metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
    return max((r["step"] for r in rows if "loss" in r), default=0)


# ---- lm demo -----------------------------------------------------------------------------------


def start_patched(module: str, name: str, marker: str, args: list[str]):
    """`lm ARGS` whose `module.name` prints `marker` and waits for a signal; returns the process
    and what it printed before the marker."""
    script = SLOW.format(module=module, name=name, marker=marker)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == marker:
            return proc, "".join(seen)
        seen.append(line)
    raise AssertionError(f"it ended before '{marker}': {proc.communicate()[1][-3000:]}")


def demo_args(workdir, corpus, steps: int) -> list[str]:
    return [
        "demo",
        "--workdir",
        str(workdir),
        f"--config.data.corpus={corpus}",
        f"--config.train.steps={steps}",
        "--config.train.log_every=1",
        "--config.eval.every_steps=0",
        *SMALL,
    ]


@pytest.mark.slow
def test_a_signal_stops_the_demo_as_a_whole_and_resume_goes_on(tmp_path, corpus):
    work = tmp_path / "demo"
    args = demo_args(work, corpus, 100000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm.cli", *args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(proc, lambda: logged_step(work / "pretrain") >= 2, "pretraining's second step")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err[-3000:]
    last = lines(err)[-1]
    assert last.startswith("lm: stopped by SIGINT during demo stage 1 (pretraining) at step "), err[-3000:]
    assert last.endswith(f"Continue with: lm demo --workdir {work} " + " ".join(args[3:]) + " --resume"), last
    assert "Traceback" not in err
    stop_step = int(last.split(" at step ")[1].split(";")[0])
    assert (work / "pretrain" / "checkpoints" / str(stop_step)).is_dir()
    assert "=== 2." not in out and not (work / "task").exists()  # no later stage started

    # --resume: the stopped pretraining resumes from its checkpoint and finishes; the next stage starts
    resumed = demo_args(work, corpus, stop_step + 2) + ["--resume"]
    proc, out = start_patched("lm.demo.pipeline", "write_sort_task", "writing the task", resumed)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=GUARD)[1]
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from step {stop_step}" in out
    assert json.loads((work / "pretrain" / "summary.json").read_text())["step"] == stop_step + 2
    assert lines(err)[-1].startswith(
        "lm: stopped by SIGTERM during demo stage 2 (the sort task); the finished "
        "stages are kept. Continue with: lm demo"
    ), err[-3000:]

    # again: the finished pretraining is not run again
    proc, out = start_patched("lm.demo.pipeline", "write_sort_task", "writing the task", resumed)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=GUARD)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "finished by an earlier run; reusing its summary" in out and "resumed from step" not in out


# ---- lm sample ---------------------------------------------------------------------------------

# `lm ARGS` whose engine announces a phase: "compile" sends SIGINT to itself just after the first
# compilation of the decoding run began (XLA compiles on its own threads meanwhile); "decode" prints
# "decoding" at its second decoding block, for the test to send a signal.
PHASES = """
import os, signal, sys, threading
import jax._src.compiler as compiler
from lm.infer.engine import engine

phase = sys.argv.pop(1)
state = {"running": False, "fired": False, "blocks": 0}
run, compile_, decode = engine.Engine.run, compiler.backend_compile_and_load, engine.Engine._decode_block

def running(self, *a, **k):
    state["running"] = True
    return run(self, *a, **k)

def compiling(*a, **k):
    if phase == "compile" and state["running"] and not state["fired"]:
        state["fired"] = True
        print("compiling", flush=True)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
    return compile_(*a, **k)

def decoding(self, *a, **k):
    state["blocks"] += 1
    if phase == "decode" and state["blocks"] == 2:
        print("decoding", flush=True)
    return decode(self, *a, **k)

engine.Engine.run, compiler.backend_compile_and_load, engine.Engine._decode_block = running, compiling, decoding
from lm.cli import end, main
end(main(sys.argv[1:]))
"""


def start_sample(phase: str, run_dir, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}("}) + "\n" for i in range(8)))
    out.write_text("the results of an earlier run\n")
    args = [
        "sample",
        "--workdir",
        str(run_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--overwrite",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "2",
    ]  # prompts wait: many decoding blocks
    proc = subprocess.Popen(
        [sys.executable, "-c", PHASES, phase, *args],
        cwd=ROOT,
        env=env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, sig", [("compile", signal.SIGINT), ("decode", signal.SIGINT), ("decode", signal.SIGTERM)]
)
def test_sample_stops_cleanly_while_compiling_and_decoding(phase, sig, small_base, tmp_path):
    proc, out = start_sample(phase, small_base, tmp_path)
    marker = "compiling" if phase == "compile" else "decoding"
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == marker:
            break
    else:
        raise AssertionError(f"it ended before '{marker}': {proc.communicate()[1][-3000:]}")
    if phase == "decode":
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])  # not -11: no crash
    assert lines(err) == [f"lm: stopped by {sig.name}; sample did not finish"], err[-3000:]
    assert out.read_text() == "the results of an earlier run\n"


# ---- data preparation with curation ------------------------------------------------------------

CURATED = [
    "--config.data.curate=true",
    "--config.data.tokenizer=byte",
    "--config.model.vocab_size=264",
    "--config.data.workers=2",
    "--config.curate.tasks=4",
    "--config.curate.c4.enabled=false",
    "--config.curate.fineweb.enabled=false",
    "--config.curate.gopher_quality.enabled=false",
    "--config.curate.gopher_repetition.enabled=false",
    "--config.curate.language.threshold=0.2",
    "--config.curate.on_bad_record=skip",
    "--config.train.steps=2",
    "--no-progress",
]


def descendants(pid: int) -> set[int]:
    """The processes below `pid`, from /proc."""
    parents = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_during_curation_stops_quietly_and_never_hangs(inherited, tmp_path, corpus):
    """Ctrl-C reaches the whole process group (a terminal's, or a script's whose background jobs
    start with SIGINT ignored): the command stops with its one line, and no worker is left."""

    def start_new_group():
        os.setpgid(0, 0)
        if inherited == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    work = tmp_path / "w"
    cache = tmp_path / "cache"  # its own: the curation must run, not be reused
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm.cli", "train", "--workdir", str(work), f"--config.data.corpus={corpus}", *CURATED],
        cwd=ROOT,
        env=env() | {"LM_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=start_new_group,
    )
    workers = set()

    def curating() -> bool:  # the worker process, its manager, forkserver and pool
        workers.update(descendants(proc.pid))
        return len(descendants(proc.pid)) >= 4

    wait_for(proc, curating, "the curation workers")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err[-3000:]
    assert lines(err) == [
        f"lm: stopped by SIGINT during data preparation; nothing is lost; run again with the "
        f"same command: lm train --workdir {work} --config.data.corpus={corpus} " + " ".join(CURATED)
    ], err[-3000:]
    deadline = time.monotonic() + GUARD
    while any(alive(p) for p in workers):
        assert time.monotonic() < deadline, "curation workers were left running"
        time.sleep(0.05)
    assert not work.exists()
