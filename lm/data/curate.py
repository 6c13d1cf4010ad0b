"""Curation: raw text files in, clean deduplicated documents out, with an account of every drop.

    report = curate(["stdlib", "data/*.jsonl.gz"], Path("curated"), config.curate, workers=2)

Inputs are files, directories or globs of text files (each file one document),
`.jsonl` / `.jsonl.gz` / `.jsonl.zst` (one document per line, `text` field) and
`.parquet` (`text` column), or 'stdlib'. The output directory gets
`part-<task>.jsonl.gz` shards, one `{"text", "id", "source"}` object per line, and
`report.json`: documents and bytes in, kept, and dropped per stage and reason.

Stages (each on or off under `curate.<stage>.enabled`): language id, Gopher
repetition, Gopher quality, C4, FineWeb, word list, exact dedup, MinHash near dedup,
PII redaction; see `lm/data/curate_plan.py` for the order. The published defaults
suit web prose. On source code (the default corpus) the prose rules drop nearly
everything (measured on the standard library: C4 drops any file with a `{` and strips
lines without terminal punctuation, FineWeb keeps 0.4% of bytes, Gopher quality ~0%,
Gopher repetition ~60%, language id at 0.65 drops ~70% of files). For code keep
dedup, PII and a lenient language id, which keeps ~97% of the standard library:

    --config.curate.gopher_repetition.enabled=false --config.curate.gopher_quality.enabled=false
    --config.curate.c4.enabled=false --config.curate.fineweb.enabled=false
    --config.curate.language.threshold=0.2 --config.curate.on_bad_record=skip

(`on_bad_record=skip` because a few standard-library files are deliberately not UTF-8.)

Crash safety and re-runs: all work happens under `<out>/.work-<fingerprint>`;
shards move into `<out>` by atomic rename only once every pass is done, and
`report.json` (written last, also by rename) marks the output complete. The
fingerprint covers the input files (path, size, mtime), the config and the number
of tasks: a re-run with the same ones returns the saved report without doing any
work, and a re-run after a crash resumes at the first unfinished datatrove task.

Beyond one machine: the passes are plain datatrove pipelines (`build_passes`), so they
run unchanged under datatrove's Slurm or Ray executors, one job per pass, each
starting when the one before has finished. Our readers use local paths, so the
inputs and `out_dir` must be on a filesystem every node mounts:

    from datatrove.executor import SlurmPipelineExecutor
    previous = None
    for i, p in enumerate(build_passes(cfg, files, tasks, work, progress=False)):
        previous = SlurmPipelineExecutor(p.steps, tasks=p.tasks, time="4:00:00", partition="cpu",
                                         job_name=f"curate-{i}", logging_dir=f"{work}/logs/{i:02d}",
                                         depends=previous)
    previous.run()  # submits the whole chain

(`RayPipelineExecutor(p.steps, tasks=p.tasks, logging_dir=...).run()` per pass, in
order, does the same on a Ray cluster.) Afterwards `collect_stats` over those
logging dirs, `curate_report.build` and the publish step below finish the job
exactly as `curate` does; only `run_passes` is specific to the local executor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

from lm.data.tokens import write_json
from lm.errors import UserError

REPORT = "report.json"
BYTES_PER_TASK = 8 << 20
MAX_TASKS = 256
_VERSION = 1  # bump when the output for the same inputs and config changes


def _import_datatrove():
    try:
        import datatrove  # noqa: F401
    except ImportError:
        raise UserError("curation needs its extra dependencies: pip install -e '.[curate]'") from None


def _fingerprint(files, cfg, tasks: int) -> str:
    """Same inputs (path, size, mtime), config (and word-list file) and task count: same output."""
    h = hashlib.sha256(json.dumps({"version": _VERSION, "config": cfg.to_dict(), "tasks": tasks},
                                  sort_keys=True).encode())
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


def _load_report(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / REPORT).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, fingerprint: str) -> dict | None:
    report = _load_report(out_dir)
    if report and report.get("fingerprint") == fingerprint and all(
        (out_dir / name).is_file() for name in report["shards"]
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
    """Runs each pass with datatrove's LocalPipelineExecutor; returns their logging dirs."""
    from datatrove.utils.logging import logger
    from tqdm import tqdm

    from lm.data.curate_blocks import QuietLocalExecutor

    log_dirs = []
    logger.remove()  # datatrove logs to files under the work dir (logs/), not the console
    try:
        for i, p in enumerate(tqdm(passes, desc="curate", unit="pass", disable=not progress)):
            log_dir = work / "logs" / f"{i:02d}-{p.name.replace(': ', '-')}"
            QuietLocalExecutor(p.steps, tasks=p.tasks, workers=max(1, min(workers, p.tasks)),
                                  logging_dir=str(log_dir)).run()
            log_dirs.append(log_dir)
    finally:
        from datatrove.utils.logging import setup_default_logger

        setup_default_logger()
    return log_dirs


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


def _publish(work: Path, out_dir: Path) -> list[str]:
    names = []
    for shard in sorted((work / "final").glob("part-*.jsonl.gz")):
        os.replace(shard, out_dir / shard.name)
        names.append(shard.name)
    return names


def curate(inputs: list[str] | str, out_dir: Path, cfg, workers: int = 1, progress: bool = True) -> dict:
    """Curates `inputs` into `out_dir` (shards + report.json) and returns the report."""
    _import_datatrove()
    from lm.data import curate_plan, curate_report
    from lm.data.curate_read import discover

    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if not inputs:
        raise UserError("curate: no inputs; pass --input PATH_OR_GLOB (or 'stdlib')")
    if workers < 1:
        raise UserError(f"--workers {workers}: expected a positive number of processes")
    curate_plan.check_config(cfg)
    out_dir = Path(out_dir)
    files, skipped_binary = discover(inputs)
    tasks = _auto_tasks(files, cfg)
    fingerprint = _fingerprint(files, cfg, tasks)
    if report := _is_complete(out_dir, fingerprint):
        if progress:
            print(f"curate: {out_dir} is up to date with these inputs and config; nothing to do")
        return report
    work = out_dir / f".work-{fingerprint}"
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_previous(out_dir, work)
    start = time.perf_counter()
    passes = curate_plan.build_passes(cfg, files, tasks, work, progress)
    stats = collect_stats(run_passes(passes, work, workers, progress))
    report = curate_report.build(stats, cfg, inputs, len(files), skipped_binary, tasks,
                                 time.perf_counter() - start)
    report["fingerprint"] = fingerprint
    report["shards"] = _publish(work, out_dir)
    write_json(out_dir / REPORT, report)
    shutil.rmtree(work)
    if progress:
        print(curate_report.table(report))
    return report
