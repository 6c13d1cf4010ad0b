"""Parts of the fault drill (bench/fault_drill.py): `lm` child processes whose output goes to
files with a deadline on every wait, reading what a run wrote (metrics, checkpoints, TensorBoard
events, params), and the damage done to checkpoints and prepared-data cache entries."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np

from lm.store.checkpoint_checks import index_entries

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Values that measure the machine, not the computation: left out of the bitwise comparison.
TIMING = re.compile(
    r"(_per_s|_s|mfu|sampling_share|peak_flops|peak_flops_source|^digest)$"
)  # digest: over the timings too


class Child:
    """One `lm` process. Its stdout and stderr go to a file, never to a pipe read at the end (a
    child that writes a lot would block on a full pipe), and every wait ends by `deadline`."""

    def __init__(self, argv: list[str], log: pathlib.Path, env: dict, timeout: float):
        self.argv, self.log = list(argv), log
        self.deadline = time.monotonic() + timeout
        self.timeout, self.hung, self.signals = timeout, False, []
        self._restored: int | None = None
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lm.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.pid = self.proc.pid

    def wait_until(self, condition, poll: float = 0.002) -> bool:
        """Polls until condition() holds (True) or the process ends or runs out of time (False)."""
        while not condition():
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > self.deadline:
                self._kill_hung()
                return False
            time.sleep(poll)
        return True

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.signals.append(signal.Signals(sig).name)
            self.proc.send_signal(sig)

    def finish(self) -> int:
        """Waits for the exit (until the deadline; then the process is killed and marked hung)."""
        try:
            return self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self._kill_hung()
            return self.proc.wait()

    def _kill_hung(self) -> None:
        self.hung = True
        self.proc.kill()
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def restored(self) -> int | None:
        """The step this child resumed from, once it has said so (its metrics.jsonl is cut back to it)."""
        if self._restored is None and (m := re.search(r"resumed from step (\d+)", self.text())):
            self._restored = int(m.group(1))
        return self._restored


def child_env(cache: pathlib.Path) -> dict:
    """CPU, unbuffered output (a kill loses no printed line), and the test suite's fast XLA
    compilation (the same program: both runs of a comparison use it)."""
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "LM_CACHE_DIR": str(cache),
        "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    }
    return env


# ---- what a run wrote -------------------------------------------------------------------------


def metric_rows(workdir: pathlib.Path) -> list[dict]:
    """metrics.jsonl's rows; a line cut short by a kill is skipped."""
    path = workdir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def values_by_step(rows: list[dict]) -> dict[int, dict]:
    """{step: {key: value}} of everything but timings (several rows of one step merged)."""
    out: dict[int, dict] = {}
    for row in rows:
        out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step" and not TIMING.search(k)})
    return out


def logged_step(workdir: pathlib.Path) -> int:
    """The last training step in metrics.jsonl (0 before the first)."""
    path = workdir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            return row["step"]
    return 0


def saved_steps(workdir: pathlib.Path) -> list[int]:
    ckpt = workdir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


def saving(workdir: pathlib.Path) -> bool:
    """An asynchronous save is under way (orbax writes into a temporary directory first)."""
    ckpt = workdir / "checkpoints"
    try:
        return any("tmp" in name for name in os.listdir(ckpt))
    except OSError:
        return False


def lock_holder(workdir: pathlib.Path) -> int | None:
    """The pid written in the workdir's lock file (the run that holds it), if any."""
    try:
        return json.loads((workdir / ".lock").read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None


def final_params(workdir: pathlib.Path, step: int) -> dict:
    from lm.store.checkpoint_read import read_checkpoint_params

    return read_checkpoint_params(workdir, step)[0]


def same_bits(a: dict, b: dict, prefix: str = "") -> str | None:
    """None if the two param trees are bitwise identical, else the first difference."""
    if set(a) != set(b):
        return f"{prefix}: keys {sorted(set(a) ^ set(b))[:4]} differ"
    for k in sorted(a):
        x, y = a[k], b[k]
        if isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict)):
                return f"{prefix}{k}: a tree and an array"
            if (diff := same_bits(x, y, f"{prefix}{k}/")) is not None:
                return diff
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return f"{prefix}{k}: differs (max |diff| {float(np.max(np.abs(x.astype(np.float64) - y))):.3g})"
    return None


def traceback_line(text: str) -> str:
    """The line that ends the first traceback (the exception), for the report."""
    lines = text[text.index("Traceback (most recent call last)") :].splitlines()
    return next((line.strip() for line in lines[1:] if line and not line.startswith(" ")), "?")[:200]


def stamp(path: pathlib.Path) -> tuple | None:
    """A file's identity and modification time (None if missing)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def summary_step(workdir: pathlib.Path):
    """The step summary.json reports (None if it is missing or unreadable)."""
    try:
        return json.loads((workdir / "summary.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None


# ---- TensorBoard ------------------------------------------------------------------------------


def tensorboard_points(directory: pathlib.Path) -> tuple[dict, str]:
    """({tag: [(step, value), ...]} over every event file, the reader used): tensorboard's own
    event reader when installed, else the records read with tensorboardX's protos (CRCs checked)."""
    out: dict[str, list] = {}
    files = sorted(directory.glob("events.out.tfevents.*"))
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        for path in files:
            for event in _records(path):
                for v in event.summary.value:
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
        return out, "tensorboardX protos"
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                value = v.simple_value if v.HasField("simple_value") else float(np.asarray(v.tensor.float_val)[0])
                out.setdefault(v.tag, []).append((event.step, value))
    return out, "tensorboard EventFileLoader"


def _records(path: pathlib.Path):
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    data, i = path.read_bytes(), 0
    while i + 12 <= len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        body = data[i + 12 : i + 12 + n]
        crcs = data[i + 8 : i + 12], data[i + 12 + n : i + 16 + n]
        if len(body) < n or len(crcs[1]) < 4:
            raise ValueError(f"{path}: a record cut short at byte {i}")
        if struct.unpack("<I", crcs[0])[0] != masked_crc32c(header) or struct.unpack("<I", crcs[1])[0] != masked_crc32c(
            body
        ):
            raise ValueError(f"{path}: bad CRC in the record at byte {i}")
        yield Event.FromString(body)
        i += 16 + n


def tensorboard_matches(workdir: pathlib.Path) -> str | None:
    """None if each tag's (step, value) points in TensorBoard equal metrics.jsonl's (values as the
    float32 an event holds), else the first difference."""
    want: dict[str, list] = {}
    for row in metric_rows(workdir):
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                want.setdefault(k, []).append((row["step"], float(np.float32(v))))
    try:
        got, _ = tensorboard_points(workdir / "tensorboard")
    except ValueError as e:
        return str(e)
    if set(got) != set(want):
        return (
            f"tags only in TensorBoard {sorted(set(got) - set(want))[:3]}, only in metrics.jsonl "
            f"{sorted(set(want) - set(got))[:3]}"
        )
    for tag, points in want.items():
        steps = [s for s, _ in got[tag]], [s for s, _ in points]
        if steps[0] != steps[1]:
            return f"'{tag}': TensorBoard steps {steps[0][:12]} != metrics.jsonl's {steps[1][:12]}"
        bad = [(s, a, b) for (s, a), (_, b) in zip(got[tag], points) if a != b]
        if bad:
            return f"'{tag}' at step {bad[0][0]}: TensorBoard {bad[0][1]!r} != metrics.jsonl {bad[0][2]!r}"
    return None


# ---- damage -----------------------------------------------------------------------------------

CHECKPOINT_DAMAGE = ("state truncated", "data state +1", "meta changed")
CACHE_DAMAGE = ("cache token changed", "cache truncated")


def damage_checkpoint(workdir: pathlib.Path, kind: str) -> dict:
    """Damages the newest checkpoint; returns {kind, step, file}."""
    step = saved_steps(workdir)[-1]
    step_dir = workdir / "checkpoints" / str(step)
    if kind == "state truncated":  # the array file holding the most data, cut inside the data it holds
        target, end = max(referenced_ends(step_dir / "state").items(), key=lambda item: item[1])
        os.truncate(target, end // 2)
    elif kind == "data state +1":  # the batch position one further: a valid JSON, a wrong place
        target = step_dir / "data" / "process_0-of-1.json"
        _bump_number(target, r'"next_index": (\d+)', r"(\d+)")
    elif kind == "meta changed":  # a fault counter the loop would carry on from, one higher
        target = step_dir / "meta" / "metadata"
        _bump_number(target, r'"skipped_steps": (\d+)', r'"checksums": \[(\d+)')
    else:
        raise ValueError(kind)
    return {"kind": kind, "step": step, "file": str(target.relative_to(workdir))}


def referenced_ends(item_dir: pathlib.Path) -> dict[pathlib.Path, int]:
    """{array file: the end of the last byte an array chunk is read from} of an OCDBT item (a file
    may hold bytes past that end that nothing reads: cutting those damages nothing)."""
    ends: dict[pathlib.Path, int] = {}
    for kind, _, path, end in index_entries(item_dir):
        if kind == "value":
            ends[path] = max(ends.get(path, 0), end)
    return ends


def _bump_number(path: pathlib.Path, pattern: str, fallback: str) -> None:
    text = path.read_text()
    m = re.search(pattern, text) or re.search(fallback, text)
    path.write_text(text[: m.start(1)] + str(int(m.group(1)) + 1) + text[m.end(1) :])


def cache_entry(cache: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path] | None:
    """(entry, token file) of the largest token file among the cache's entries (the training data)."""
    found = [
        p
        for p in cache.glob("*/**/*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(cache).parts)
        and (p.name == "tokens.npy" or p.suffix == ".tokens")
    ]
    if not found:
        return None
    path = max(found, key=lambda p: p.stat().st_size)
    return cache / path.relative_to(cache).parts[0], path


def damage_cache(cache: pathlib.Path, kind: str) -> dict | None:
    """Changes one token id of the training data's cache entry, or truncates its token file."""
    found = cache_entry(cache)
    if found is None:
        return None
    entry, path = found
    if kind == "cache truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "cache token changed":
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r+")
        else:
            manifest = json.loads((path.parent / "manifest.json").read_text())
            tokens = np.memmap(path, dtype=manifest.get("dtype", "uint16"), mode="r+")
        flat = tokens.reshape(-1)
        i = flat.size // 2
        flat[i] = flat[i] + 1 if flat[i] < 255 else flat[i] - 1
        tokens.flush()
        del tokens, flat
    else:
        raise ValueError(kind)
    return {"kind": kind, "entry": entry.name, "file": str(path.relative_to(cache))}


def table(columns: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    """Text table: headers wrapped to each column's width (bottom-aligned), the first column left."""
    wrapped = [textwrap.wrap(head, width) for head, width in columns]
    depth = max(map(len, wrapped))
    heads = [
        [(parts[i - depth + len(parts)] if i >= depth - len(parts) else "") for parts in wrapped] for i in range(depth)
    ]
    return [
        " ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, (_, w)) in enumerate(zip(cells, columns)))
        for cells in heads + rows
    ]
