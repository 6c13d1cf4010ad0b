"""SIGTERM while `lm dpo` reads its init model (a run directory: an orbax checkpoint) stops it with
the one-line stop message and exit code 0: no traceback from the event loop or the reads orbax
had begun (lm.store.load reads on a worker thread, so the stop lands in the main thread's wait).

The command runs in a subprocess whose orbax waits for the signal at a chosen point of its first
read: while it makes its event loop ("loop": the loop is half made), or inside the loop while a
read is awaited ("read"). The test waits for the subprocess to say it got there."""

import shlex
import signal
import subprocess
import sys

import pytest

from lm.data.synthetic import write_sort_pairs
from tests.e2e.test_signals import GUARD, ROOT, env, lines

WAITING = "reading the init model"

SCRIPT = f"""
import asyncio, sys, time
from asyncio import selector_events
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as handler

where = sys.argv.pop(1)
run_sync, make_pipe = asyncio_utils._run_sync_via_new_loop, selector_events.BaseSelectorEventLoop._make_self_pipe
reading = []

def via_new_loop(coro):
    reading.append(True)
    return run_sync(coro)

def self_pipe(loop):
    if where == "loop" and reading:
        print("{WAITING}", flush=True)
        time.sleep(600)  # until a signal ends it
    return make_pipe(loop)

async def deserialize(*args, **kwargs):
    print("{WAITING}", flush=True)
    await asyncio.sleep(600)

asyncio_utils._run_sync_via_new_loop, selector_events.BaseSelectorEventLoop._make_self_pipe = via_new_loop, self_pipe
if where == "read":
    handler.BasePyTreeCheckpointHandler._maybe_deserialize = deserialize
from lm.cli import end, main
end(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["loop", "read"])
def test_sigterm_while_dpo_reads_its_init_model_prints_one_line(where, small_base, tmp_path):
    data = write_sort_pairs(tmp_path, n_train=4, n_heldout=1)["train"]
    work = tmp_path / "dpo"
    args = ["dpo", "--init", str(small_base), "--data", str(data), "--workdir", str(work), "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, where, *args],
        cwd=ROOT,
        env=env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == WAITING:
            break
    else:
        raise AssertionError(f"it ended before '{WAITING}': {proc.communicate()[1][-3000:]}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err[-3000:]
    assert lines(err) == [
        f"lm: stopped by SIGTERM during loading the init model; nothing is lost; run again with "
        f"the same command: lm {shlex.join(args)}"
    ], err[-3000:]
    assert "Traceback" not in err
    assert not (work / "checkpoints").exists()
