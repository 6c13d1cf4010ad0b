"""Running a curation locally: fingerprint, passes, counts, publish, report."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import time
from pathlib import Path

from lm.data import progress as shown
from lm.data.tokens import write_json
from lm.errors import UserError

REPORT = "report.json"
BYTES_PER_TASK = 8 << 20
MAX_TASKS = 256
STOP_GRACE = 30.0  # seconds a curation worker process has to end on a stop before it is killed
_VERSION = 1  # bump when the output for the same inputs and config changes


def _import_datatrove():
    try:
        import datatrove  # noqa: F401
    except ImportError:
        raise UserError("curation needs its extra dependencies: pip install -e '.[curate]'") from None


def _datatrove_version() -> str | None:
    try:
        return importlib.metadata.version("datatrove")
    except importlib.metadata.PackageNotFoundError:
        return None


def _fingerprint(files, cfg, tasks: int) -> str:
    """Same inputs (path, size, mtime), config (and word-list file) and task count: same output."""
    h = hashlib.sha256(
        json.dumps(
            {"version": _VERSION, "datatrove": _datatrove_version(), "config": cfg.to_dict(), "tasks": tasks},
            sort_keys=True,
        ).encode()
    )
    paths = [(f.path, f.rel) for f in files] + ([(cfg.word_list.path, "")] if cfg.word_list.enabled else [])
    for path, rel in paths:
        st = os.stat(path)
        h.update(f"{path}\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _auto_tasks(files, cfg) -> int:
    if cfg.tasks:
        return cfg.tasks
    total = sum(os.path.getsize(f.path) for f in files)
    return max(1, min(len(files), MAX_TASKS, math.ceil(total / BYTES_PER_TASK)))


def _plan_inputs(inputs: list[str], cfg, labels: list[str] | None):
    """(files, skipped binary files, tasks, fingerprint) of the inputs under this config."""
    from lm.data.curate.read import discover
    from lm.data.curate.settings import check_config

    if not inputs:
        raise UserError("curate: no inputs; pass --input PATH_OR_GLOB (or 'stdlib')")
    check_config(cfg)
    files, skipped_binary = discover(inputs, labels)
    tasks = _auto_tasks(files, cfg)
    return files, skipped_binary, tasks, _fingerprint(files, cfg, tasks)


def curate_key(inputs: list[str] | str, cfg, labels: list[str] | None = None) -> str:
    """The fingerprint a curation of `inputs` under `cfg` gets: it changes with any input file
    (path, size, mtime), setting or the task count. Cheap: reads no document, needs no datatrove."""
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    return _plan_inputs(inputs, cfg, labels)[3]


def _load_report(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / REPORT).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, fingerprint: str) -> dict | None:
    report = _load_report(out_dir)
    if (
        report
        and report.get("fingerprint") == fingerprint
        and all((out_dir / name).is_file() for name in report["shards"])
    ):
        return report
    return None


def _clear_previous(out_dir: Path, work: Path) -> None:
    """Removes an older run's marker first, then its shards and stale work dirs."""
    (out_dir / REPORT).unlink(missing_ok=True)
    for shard in out_dir.glob("part-*.jsonl.gz"):
        shard.unlink()
    for old in out_dir.glob(".work-*"):
        if old != work:
            shutil.rmtree(old)


def run_passes(passes, work: Path, workers: int, progress: bool) -> list[Path]:
    """Runs each pass with datatrove's LocalPipelineExecutor; returns their logging dirs.

    Progress: a bar over the passes on a terminal, one line per finished pass in a log."""
    from datatrove.utils.logging import logger
    from tqdm import tqdm

    from lm.data.curate.blocks import QuietLocalExecutor

    log_dirs = []
    lines = shown.StageLines("curate", len(passes), shown.lines(progress))
    logger.remove()  # datatrove logs to files under the work dir (logs/), not the console
    try:
        for i, p in enumerate(tqdm(passes, desc="curate", unit="pass", disable=not shown.bars(progress))):
            log_dir = work / "logs" / f"{i:02d}-{p.name.replace(': ', '-')}"
            QuietLocalExecutor(
                p.steps, tasks=p.tasks, workers=max(1, min(workers, p.tasks)), logging_dir=str(log_dir)
            ).run()
            log_dirs.append(log_dir)
            lines.finished(f"pass '{p.name}'")
    finally:
        from datatrove.utils.logging import setup_default_logger

        setup_default_logger()
    return log_dirs


def _build_and_run(cfg, files, tasks: int, work: Path, workers: int, progress: bool) -> list[Path]:
    from lm.data.curate.plan import build_passes

    passes = build_passes(cfg, files, tasks, work, shown.bars(progress))
    return run_passes(passes, work, workers, progress)


def _run_local(cfg, files, tasks: int, work: Path, workers: int, progress: bool) -> list[Path]:
    """Runs the passes in a fresh process: datatrove forks (its manager and worker pools), and a
    fork of a process running JAX's threads can deadlock; and a stop here ends that process and
    all it started, quietly (`in_worker_process`)."""
    return in_worker_process(_build_and_run, cfg, files, tasks, work, workers, progress)


def in_worker_process(fn, *args):
    """`fn(*args)` in a fresh (spawned) process, its result or error returned or raised here.

    The worker and everything it starts form a process group of their own with SIGINT blocked:
    Ctrl-C at a terminal reaches this process alone, which decides. On a stop here (or any
    error) the worker's group is asked to end (SIGTERM: the worker unwinds, its pools' processes
    end), and killed if the worker has not ended within STOP_GRACE seconds; if this process dies,
    the worker is asked to end the same way (Linux)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker_main, args=(send, fn, args), name="lm-curate")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited by the worker
    try:
        worker.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C meanwhile is delivered here now
    send.close()
    try:
        try:
            ok, value = receive.recv()
        except EOFError:
            worker.join()
            raise RuntimeError(f"the curation process ended without a result (exit code {worker.exitcode})") from None
        worker.join()
    except BaseException:
        _end_worker(worker)
        raise
    finally:
        receive.close()
    if not ok:
        raise value
    return value


def _worker_main(send, fn, args) -> None:
    os.setpgid(0, 0)
    leader = os.getpid()

    def end(signum, frame):  # from the parent, or on its death (below)
        if os.getpid() != leader:  # a process the worker forked: its own parent ends it
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, end)
    _die_with_parent(signal.SIGTERM)
    try:
        result = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        result = (False, e)
    try:
        send.send(result)
    except Exception as e:  # an error that does not pickle: its text still does
        send.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]} ({e})")))
    send.close()


def _die_with_parent(signum: int) -> None:
    """Asks Linux to send `signum` to this process when its parent dies (elsewhere: nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_worker(worker) -> None:
    """Asks the worker and everything it started to end (SIGTERM to its process group: the pool's
    processes and its fork server end at once, so none is left spawning a child from a pool the
    worker is tearing down), then kills the group: at once if the worker has not ended within
    STOP_GRACE seconds, else whatever it left behind."""
    if worker.pid is None:
        return
    try:
        os.killpg(worker.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):  # no group of its own yet: the worker alone
        worker.terminate()
    worker.join(STOP_GRACE)
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no group (left): the worker alone
        worker.kill()
    worker.join()


def collect_stats(log_dirs: list[Path]) -> dict[str, dict[str, float]]:
    """Sums our blocks' counters over all tasks of all passes: {block name: {label: total}}."""
    out: dict[str, dict[str, float]] = {}
    for log_dir in log_dirs:
        for task_file in sorted((log_dir / "stats").glob("*.json")):
            for block in json.loads(task_file.read_text()):
                name = block["name"].rsplit(": ", 1)[-1]
                if not name.startswith("lm:"):
                    continue
                totals = out.setdefault(name[3:], {})
                for label, value in block["stats"].items():
                    totals[label] = totals.get(label, 0) + (value["total"] if isinstance(value, dict) else value)
    return out


def skipped_records(work: Path) -> list[str]:
    """The first skipped records ("FILE:LINE: problem") the readers of all tasks listed, in order."""
    from lm.data.curate.blocks import LISTED_BAD_RECORDS
    from lm.data.curate.read import BAD_RECORDS

    def place(line: str) -> tuple[str, int]:  # (file, line number): line 10 after line 9
        m = re.match(r"(.*?)(?::(\d+))?: ", line)
        return (m.group(1), int(m.group(2) or 0)) if m else (line, 0)

    lines = [line for f in sorted((work / BAD_RECORDS).glob("*.txt")) for line in f.read_text().splitlines()]
    return sorted(lines, key=place)[:LISTED_BAD_RECORDS]


def _publish(work: Path, out_dir: Path) -> list[str]:
    names = []
    for shard in sorted((work / "final").glob("part-*.jsonl.gz")):
        os.replace(shard, out_dir / shard.name)
        names.append(shard.name)
    return names


def curate(
    inputs: list[str] | str,
    out_dir: Path,
    cfg,
    workers: int = 1,
    progress: bool = True,
    show_report: bool = True,
    labels: list[str] | None = None,
) -> dict:
    """Curates `inputs` into `out_dir` (shards + report.json) and returns the report.

    `progress` shows work under way; `show_report` prints the report table (a result, so
    independent of `progress`). `labels` name the inputs in messages (default '--input')."""
    _import_datatrove()
    from lm.data.curate import report as reports

    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if workers < 1:
        raise UserError(f"--workers {workers}: expected a positive number of processes")
    files, skipped_binary, tasks, fingerprint = _plan_inputs(inputs, cfg, labels)
    out_dir = Path(out_dir)
    if report := _is_complete(out_dir, fingerprint):
        if progress:
            print(f"curate: {out_dir} is up to date with these inputs and config; nothing to do")
        _check_kept(report, inputs, labels, out_dir)
        return report
    work = out_dir / f".work-{fingerprint}"
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_previous(out_dir, work)
    start = time.perf_counter()
    stats = collect_stats(_run_local(cfg, files, tasks, work, workers, progress))
    report = reports.build(
        stats,
        cfg,
        inputs,
        len(files),
        skipped_binary,
        tasks,
        time.perf_counter() - start,
        bad_records=skipped_records(work),
    )
    report["fingerprint"] = fingerprint
    report["shards"] = _publish(work, out_dir)
    write_json(out_dir / REPORT, report)
    shutil.rmtree(work)
    if show_report:
        print(reports.table(report))
    _check_kept(report, inputs, labels, out_dir)
    return report


def _check_kept(report: dict, inputs: list[str], labels: list[str] | None, out_dir: Path) -> None:
    """A curation that kept no document is an error (its report stays, for inspection)."""
    from lm.data.curate.report import kept_nothing

    if (problem := kept_nothing(report)) is not None:
        named = ", ".join(f"{label} '{spec}'" for label, spec in zip(labels or ["--input"] * len(inputs), inputs))
        raise UserError(f"curation kept no documents of {named}: {problem}; see {out_dir / REPORT}")
