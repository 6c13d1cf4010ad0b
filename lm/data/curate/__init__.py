"""Curation: raw text files in, clean deduplicated documents out, with an account of every drop.

    report = curate(["stdlib", "data/*.jsonl.gz"], Path("curated"), config.curate, workers=2)

Inputs are files, directories or globs of text files (each file one document),
`.jsonl` / `.jsonl.gz` / `.jsonl.zst` (one document per line, `text` field) and
`.parquet` (`text` column), or 'stdlib'. The output directory gets
`part-<task>.jsonl.gz` shards, one `{"text", "id", "source"}` object per line, and
`report.json`: documents and bytes in, kept, and dropped per stage and reason.

Stages (each on or off under `curate.<stage>.enabled`): language id, Gopher
repetition, Gopher quality, C4, FineWeb, word list, exact dedup, MinHash near dedup,
PII redaction; see `plan.py` for the order. The published defaults
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
fingerprint covers the input files (path, size, mtime), the config, the number
of tasks and the datatrove version: a re-run with the same ones returns the saved report without doing any
work, and a re-run after a crash resumes at the first unfinished datatrove task.

Beyond one machine: the passes are plain datatrove pipelines (`plan.build_passes`), so they
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
order, does the same on a Ray cluster.) Afterwards `run.collect_stats` over those
logging dirs, `report.build` and the publish step of `run.curate` finish the job
exactly as `curate` does; only `run.run_passes` is specific to the local executor.
"""

from lm.data.curate.run import REPORT, curate, curate_key

__all__ = ["REPORT", "curate", "curate_key"]
