"""A workdir has one writer at a time (a lock naming its holder, taken over from a dead process,
released on exit) and everything a run writes there is checked writable first."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from lm.errors import UserError
from lm.train.workdir import LOCK, check_writable, lock_workdir, write_atomic

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOLD = """
import sys
from lm.train.workdir import lock_workdir
lock = lock_workdir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
lock.release()
"""


def _permissions_apply() -> bool:
    """False for root with its override capability: chmod keeps it out of nothing."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o555)
        try:
            return not os.access(d, os.W_OK)
        finally:
            os.chmod(d, 0o755)


permissions_apply = pytest.mark.skipif(not _permissions_apply(), reason="root ignores file permissions")


def holder(workdir):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


def test_a_second_lock_is_refused_naming_its_holder_and_released_on_exit(tmp_path):
    work = tmp_path / "a" / "run"
    with lock_workdir(work):
        saved = json.loads((work / LOCK).read_text())
        assert saved["pid"] == os.getpid() and saved["host"] == socket.gethostname()
        with pytest.raises(UserError) as refused:
            lock_workdir(work)
        message = str(refused.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()} since {saved['since']}" in message
        assert "\n" not in message and "--workdir" in message
    assert not (tmp_path / "a").exists()  # released: the lock file and the folders it created are gone
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    lock_workdir(tmp_path / "b").release()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["config.json"]


def test_another_process_holds_the_lock_until_it_dies(tmp_path):
    proc = holder(tmp_path / "w")
    try:
        with pytest.raises(UserError, match=f"in use by another run \\(pid {proc.pid} on host"):
            lock_workdir(tmp_path / "w")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and (tmp_path / "w" / LOCK).exists()  # a stale lock file
    with lock_workdir(tmp_path / "w"):  # taken over: the kernel released the dead process's lock
        assert json.loads((tmp_path / "w" / LOCK).read_text())["pid"] == os.getpid()

    proc = holder(tmp_path / "w")  # a holder that ends normally removes its lock file
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0 and not (tmp_path / "w" / LOCK).exists()


def test_taking_over_a_stale_lock_file_says_whose_it_was(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / LOCK).write_text(json.dumps({"pid": 999999, "host": "gone", "since": "yesterday"}))
    lock_workdir(tmp_path / "w").release()
    assert "taking over" in capsys.readouterr().err and not (tmp_path / "w" / LOCK).exists()


@permissions_apply
@pytest.mark.parametrize(
    "make,named",
    [
        (lambda w: w.parent.chmod(0o555), ""),
        (lambda w: (w.mkdir(), w.chmod(0o555)), "w"),
        (
            lambda w: (w.mkdir(), (w / "metrics.jsonl").write_text(""), (w / "metrics.jsonl").chmod(0o444)),
            "w/metrics.jsonl",
        ),
        (lambda w: ((w / "checkpoints").mkdir(parents=True), (w / "checkpoints").chmod(0o555)), "w/checkpoints"),
        (
            lambda w: ((w / "checkpoints" / "4").mkdir(parents=True), (w / "checkpoints" / "4").chmod(0o555)),
            "w/checkpoints/4",
        ),
        (lambda w: ((w / "tensorboard").mkdir(parents=True), (w / "tensorboard").chmod(0o555)), "w/tensorboard"),
    ],
)
def test_what_a_run_writes_must_be_writable(tmp_path, make, named):
    work = tmp_path / "parent" / "w"
    work.parent.mkdir()
    make(work)
    try:
        with pytest.raises(UserError) as refused:
            check_writable(work)
    finally:
        for p in [work.parent, *work.parent.rglob("*")]:
            p.chmod(0o755)
    message = str(refused.value)
    assert (
        f"'{pathlib.Path(tmp_path, 'parent', named)}'" in message and "not writable" in message and "\n" not in message
    )
    check_writable(work)


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="is a file"):
        check_writable(tmp_path / "f")
    with pytest.raises(UserError, match="is a file"):
        check_writable(tmp_path / "f" / "w")


def test_write_atomic_replaces_the_file_whole(tmp_path):
    write_atomic(tmp_path / "summary.json", "old")
    write_atomic(tmp_path / "summary.json", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"] and (tmp_path / "summary.json").read_text() == "new"
