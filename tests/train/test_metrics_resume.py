"""Run metrics across kills: TensorBoard shows each step once with the values of metrics.jsonl,
metrics.jsonl is cut back atomically on resume, and a row cut short by a kill is dropped."""

import json
import pathlib
import signal
import struct
import subprocess
import sys

import pytest
from tensorboardX.proto.event_pb2 import Event

from lm import outputs
from lm.errors import UserError
from lm.train.metrics import MetricsWriter, read_metrics, truncate_after

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A run that writes steps 0..last, flushes at its checkpoint (10) and maybe at `timed` (a timed
# flush past the checkpoint), then is killed.
CHILD = """
import os, signal, sys
from lm.train.metrics import MetricsWriter
from tests.train.test_metrics_resume import values
workdir, last, timed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
writer = MetricsWriter(workdir)
for step in range(last + 1):
    writer.write(step, values(step))
    if step in (10, timed):
        writer.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def values(step: int, run: int = 0) -> dict:
    row = {"loss": 1.0 / (step + 1) + run, "lr": 0.01 * step, "note": "text is not a scalar"}
    return row | ({"eval_loss": 2.0 / (step + 1) + run} if step % 5 == 0 else {})


def killed_run(workdir, last: int, timed: int = -1) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(workdir), str(last), str(timed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def events(directory: pathlib.Path) -> dict:
    """{tag: [(step, value), ...]} over every event file, read record by record (length, crc, data, crc)."""
    out = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            body = data[i + 12 : i + 12 + n]
            i += 12 + n + 4
            if len(body) < n:
                break  # a record cut short by the kill
            event = Event.FromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def assert_events_match(workdir: pathlib.Path) -> None:
    """Every numeric metric of metrics.jsonl is in TensorBoard at its step, once, with its value."""
    want = {}
    for row in read_metrics(workdir / "metrics.jsonl"):
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                want.setdefault(k, []).append((row["step"], v))
    got = events(workdir / "tensorboard")
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag  # each step once, in order
        for (_, a), (_, b) in zip(got[tag], points):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-30), tag  # events hold float32


@pytest.mark.parametrize("timed", [-1, 15], ids=["flushed-at-checkpoint", "flushed-past-checkpoint"])
def test_tensorboard_after_kill_and_resume_shows_each_step_once(tmp_path, timed):
    killed_run(tmp_path, last=17, timed=timed)  # checkpoint at 10, killed at 17
    truncate_after(tmp_path / "metrics.jsonl", 10)  # the resume, as fit does it
    writer = MetricsWriter(tmp_path)
    for step in range(11, 21):
        writer.write(step, values(step, run=1))
    writer.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(21))
    assert rows[-1]["loss"] == pytest.approx(1 / 21 + 1)  # the resumed run's values, not the killed one's
    assert_events_match(tmp_path)


def test_writer_dropped_without_close_then_resumed(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(21):
        writer.write(step, values(step))
        if step == 10:
            writer.flush()
    del writer  # no close: what a kill leaves
    truncate_after(tmp_path / "metrics.jsonl", 10)
    writer = MetricsWriter(tmp_path)
    for step in range(11, 21):
        writer.write(step, values(step, run=1))
    writer.close()
    assert_events_match(tmp_path)


def test_fresh_start_after_a_kill_before_any_checkpoint_keeps_no_stale_events(tmp_path):
    killed_run(tmp_path, last=6, timed=6)
    (tmp_path / "metrics.jsonl").replace(tmp_path / "metrics.jsonl.prev")  # fit's fresh start
    writer = MetricsWriter(tmp_path)
    for step in range(3):
        writer.write(step, values(step, run=1))
    writer.close()
    assert_events_match(tmp_path)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


def write_rows(path: pathlib.Path, steps) -> str:
    text = "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in steps)
    path.write_text(text)
    return text


class Killed(BaseException):
    pass


def test_truncation_killed_mid_write_leaves_the_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = write_rows(path, range(20))
    real_open = open

    def open_then_die_on_write(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" not in mode:
            return f

        class Dying:  # the file is open (truncated); the process dies before the first byte lands
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, _):
                raise Killed

        return Dying()

    monkeypatch.setattr(outputs, "open", open_then_die_on_write, raising=False)  # lm.outputs writes it
    with pytest.raises(Killed):
        truncate_after(path, 10)
    monkeypatch.undo()
    assert path.read_text() == text
    truncate_after(path, 10)  # the next resume does it
    assert [r["step"] for r in read_metrics(path)] == list(range(11))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left


def test_partial_last_line_is_dropped_with_a_note(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, range(15))
    with path.open("a") as f:
        f.write('{"step": 15, "loss": 0.0')  # killed mid-row
    assert [r["step"] for r in read_metrics(path)] == list(range(15))
    truncate_after(path, 10)
    assert f"{path}:16: dropped a partial last line" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(path)] == list(range(11))
    assert path.read_text().endswith("}\n")
    truncate_after(path, 10)  # and every later resume works
    assert [r["step"] for r in read_metrics(path)] == list(range(11))


def test_a_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, range(5))
    with path.open("a") as f:
        f.write('{"step": 5, "loss": 0.5}')
    truncate_after(path, 10)
    assert [r["step"] for r in read_metrics(path)] == list(range(6))


@pytest.mark.parametrize(
    "bad, problem", [('{"step": 3, "lo\n', "malformed JSON"), ('{"loss": 1.0}\n', "integer 'step'")]
)
def test_a_bad_line_before_the_end_is_an_error_naming_file_and_line(tmp_path, bad, problem):
    path = tmp_path / "metrics.jsonl"
    text = write_rows(path, range(3)) + bad + json.dumps({"step": 4, "loss": 0.2}) + "\n"
    path.write_text(text)
    with pytest.raises(UserError, match=f"{path}:4: .*{problem}"):
        truncate_after(path, 10)
    assert path.read_text() == text
    if not bad.endswith("}\n"):  # the same line cut short at the very end is a kill, not an error
        path.write_text(text[: -len(json.dumps({"step": 4, "loss": 0.2})) - 2])
        truncate_after(path, 10)
        assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_no_temporary_file_is_left(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, range(5))
    truncate_after(path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
