"""The wiring every training stage shares, after its data is ready: checkpoints (fresh start or
exact resume), the jitted step, held-out evaluation, metrics, MFU, signals and faults, the loop.

A stage (pretraining, SFT, ...) builds its run (lm.train.setup), its data iterator and its
evaluation, then calls `fit`; what it does before and after is its own.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Callable

import jax

from lm.errors import UserError
from lm.model import counts
from lm.model.params import leaf_paths
from lm.store.checkpoint import Checkpointer, IncompatibleCheckpoint
from lm.store.checkpoint_read import read_meta, saved_steps
from lm.train.faults import FaultPolicy, StopSignal, agree_any
from lm.train.identity import check_identity, flat_keys
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.metrics import MetricsWriter, json_default, metrics_problem, read_metrics, truncate_after
from lm.train.perf import measure_matmul_peak
from lm.train.steps import summarize
from lm.train.workdir import write_atomic

FINAL_METRICS = "final_metrics.json"  # the loop's final metrics: what the end-of-run work reports


def check_resume(directory: pathlib.Path, resume: bool, total_steps: int) -> int | None:
    """--resume needs a checkpoint and a fresh run must not find one: checked before any data work.

    Returns the final step when the run already reached `total_steps` (nothing left to do).
    """
    steps = saved_steps(directory)
    if resume and not steps:
        raise UserError(f"--resume: no checkpoint in '{directory}'; run without --resume to start fresh")
    if not resume and steps:
        raise UserError(
            f"'{directory.parent}' already holds checkpoints (steps {steps[0]}..{steps[-1]}); "
            "pass --resume to continue, or use a new --workdir"
        )
    return steps[-1] if resume and steps[-1] >= total_steps else None


def newest_meta(directory: pathlib.Path) -> tuple[int | None, dict]:
    """(step, meta) of the newest checkpoint whose meta can be read, or (None, {}). A step whose
    meta cannot be read is left to the restore, which tells damage from a storage fault."""
    for step in reversed(saved_steps(directory)):
        try:
            meta = read_meta(directory, step)
            if isinstance(meta, dict) and isinstance(meta.get("shapes"), dict):
                return step, meta
        except Exception:  # noqa: BLE001 - damaged or unreadable: not this check's business
            continue
    return None, {}


def check_made_by(
    directory: pathlib.Path, identity: dict, parts: tuple = (), updates_per_step: int | None = None
) -> None:
    """The newest checkpoint must be this run's (its stage and run id, then `parts` of its
    identity, and the schedule of its updates when `updates_per_step` is known): checked on its
    metadata before any data work (parts=()) and again once the run is built (every part);
    restoring checks each checkpoint again."""
    step, meta = newest_meta(directory)
    if step is not None:
        updates = step * updates_per_step if updates_per_step else None
        check_identity(meta.get("identity"), identity, f"checkpoint step {step} in '{directory}'", parts, updates)


def check_fits(run, directory: pathlib.Path) -> None:
    """The newest checkpoint must hold the arrays `run` has: checked on its metadata before a resume
    writes anything (restoring checks each checkpoint again)."""
    step, meta = newest_meta(directory)
    if step is not None:
        saved = dict(meta["shapes"])
        now = _shapes(run.abstract_state())
        diffs = [
            f"{p}: saved {saved[p][0]} {saved[p][1]}, now {now[p][0]} {now[p][1]}"
            for p in now
            if p in saved and list(saved[p]) != now[p]
        ]
        diffs += [f"{p}: missing in the checkpoint" for p in now if p not in saved]
        diffs += [f"{p}: not in this config" for p in saved if p not in now]
        if diffs:
            diffs = [d for d in diffs if d.startswith("params/")] or diffs  # the optimizer state mirrors them
            shown = "; ".join(diffs[:10]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 10 else "")
            raise IncompatibleCheckpoint(
                f"checkpoint step {step} in '{directory}' does not fit this config: {shown}"
                f"{_model_keys(meta.get('config'), run.config)}; use the config it was "
                "trained with or a new --workdir"
            )


def _shapes(tree) -> dict:
    return {p: [list(x.shape), str(x.dtype)] for p, x in zip(leaf_paths(tree), jax.tree.leaves(tree))}


def _model_keys(saved: dict | None, config) -> str:
    """The model keys whose values differ between a checkpoint's config and `config`, as text."""
    if not isinstance(saved, dict):
        return ""
    before, after = flat_keys(saved.get("model") or {}), flat_keys(json.loads(config.to_json()).get("model", {}))
    changed = [
        f"model.{k}={before.get(k)!r} (checkpoint) vs {after.get(k)!r} (now)"
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k)
    ]
    return f"; config differs in {', '.join(changed)}" if changed else ""


def save_final_metrics(workdir, last: dict) -> None:
    """Keeps the loop's final metrics (throughput included), for a run killed during its end-of-run work."""
    write_atomic(pathlib.Path(workdir) / FINAL_METRICS, json.dumps(last, default=json_default))


def final_metrics(workdir, step: int) -> dict:
    """The loop's final metrics of a run trained to `step`: as saved at its end, or (killed before they
    were saved) rebuilt from its metrics.jsonl rows at that step, without the run-wide throughput."""
    workdir = pathlib.Path(workdir)
    try:
        last = json.loads((workdir / FINAL_METRICS).read_text())
        if last.get("stop_step") == step and not last.get("stopped_by"):
            return last
    except (OSError, ValueError, AttributeError):
        pass
    print(
        f"lm: note: {workdir / FINAL_METRICS} is missing or not of step {step}; the summary takes the metrics "
        f"logged at step {step} (no run-wide throughput)",
        file=sys.stderr,
    )
    rows = [r for r in read_metrics(workdir / "metrics.jsonl") if r["step"] == step]
    kept = {k: v for r in rows for k, v in r.items() if k not in ("step", "digest")}
    return kept | {"stopped_by": None, "stop_step": step}


def evaluator(eval_fn, batches: list, placer, frozen=None, prefix: str = "eval", metrics=("loss",)) -> Callable:
    """Held-out statistics over fixed batches: state -> {'<prefix>_<metric>', '<prefix>_tokens'}
    for the summarized (lm.train.steps.summarize) `metrics`; each process feeds the rows its devices hold."""

    def evaluate(state):
        total = None
        for batch in batches:
            args = (state.params, placer.from_global(batch)) + ((frozen,) if frozen is not None else ())
            stats = jax.device_get(eval_fn(*args))
            total = stats if total is None else jax.tree.map(lambda a, b: a + b, total, stats)
        means = {k: float(v) for k, v in jax.device_get(summarize(total)).items()}
        return {f"{prefix}_{k}": means[k] for k in (*metrics, "tokens")}

    return evaluate


def peak_flops(config) -> tuple[float, str]:
    """The peak FLOP/s that MFU divides by, and where it came from."""
    if config.train.peak_flops > 0:
        return config.train.peak_flops, "train.peak_flops (given)"
    n = len(jax.devices())
    per_device = measure_matmul_peak(config.model.compute_dtype)
    return per_device * n, (
        f"measured at start-up: a 2048^3 {config.model.compute_dtype} matmul on one device "
        f"({per_device / 1e9:.0f} GFLOP/s) x {n} device(s); set train.peak_flops to the "
        "vendor's figure for a stable MFU"
    )


def _accepting(identity: dict | None, directory: pathlib.Path, updates_per_step: int) -> Callable[[int, dict], None]:
    """The restore's test of a checkpoint's identity (lm.train.identity): another stage's, run's or
    trajectory's is refused; one saved before identities existed passes with one warning."""
    warned = []

    def accept(step: int, meta: dict) -> None:
        if identity is None:
            return
        if not meta.get("identity"):
            if not warned:
                print(
                    f"lm: warning: checkpoint step {step} in '{directory}' predates run identities: the stage, "
                    "run and settings that made it are unchecked",
                    flush=True,
                )
                warned.append(step)
            return
        check_identity(
            meta["identity"], identity, f"checkpoint step {step} in '{directory}'", updates=step * updates_per_step
        )

    return accept


def _check_metrics(workdir: pathlib.Path, step: int, meta: dict, is_main: bool) -> None:
    """metrics.jsonl up to the restored step must be what the run wrote (lm.train.metrics digests),
    checked before the resume writes anything; all processes refuse together."""
    path = workdir / "metrics.jsonl"
    problem = metrics_problem(path, step, meta.get("metrics_digest")) if is_main else None
    if agree_any([problem is not None])[0]:
        raise UserError(
            f"{problem or 'process 0 found metrics.jsonl edited'}; metrics.jsonl is the run's record: "
            f"put the original back, or move it aside (mv '{path}' '{path}.edited') to resume with a "
            f"record that starts after step {step}"
        )


def fit(
    run,
    workdir,
    data_iter,
    *,
    resume: bool,
    init: Callable,
    ready: Callable[[], None] = lambda: None,
    evaluate: Callable | None = None,
    first_row: dict | None = None,
    frozen=None,
    signature: dict | None = None,
    show_progress: bool = True,
    flops_per_token: float | None = None,
    step_fn: Callable | None = None,
    identity: dict | None = None,
):
    """Trains `run` from a fresh `init()` state (or the newest checkpoint when resuming) to
    config.train.steps. Returns (state, last) where last holds the final logged and eval metrics,
    run throughput, `stopped_by` (a signal's name when one ended the run early) and the peak.

    ready: called once the state is restored (or made), before fit writes anything: a resume the
    checkpoints refuse leaves the workdir as it was.
    A resumed run whose checkpoint already reached train.steps (killed during its end-of-run work)
    trains no further: its state comes back with the loop's final metrics (`final_metrics`).
    first_row: step-0 metrics of a fresh run (evaluate(state) is added to it).
    flops_per_token: for MFU (default: the trained model's, lm.model.counts.flops_per_token).
    step_fn: `step(state, host batch) -> (state, metrics)` of a stage whose step is more than the
    jitted update (RL: rollouts, rewards, several updates); it places its own data, and
    `signature` then describes the rows its updates see (for tokens/s).
    identity: the run's (lm.train.identity), recorded in every checkpoint; a resume restores only
    a checkpoint with the same one.
    """
    config, workdir = run.config, pathlib.Path(workdir)
    t, is_main = config.train, jax.process_index() == 0
    signature = signature or run.signature()
    to_device = (lambda batch: batch) if step_fn is not None else run.placer(signature)
    writer = None
    checkpointer = Checkpointer.from_config(
        workdir / "checkpoints",
        config,
        identity=identity,
        accept=_accepting(identity, workdir / "checkpoints", run.updates_per_step),
        metrics_digest=lambda: writer.digest if writer is not None else "",
    )
    target = run.abstract_state()
    health = None
    if resume:
        state, step, meta = checkpointer.restore(target, data_iter)
        health = meta.get("health")
        _check_metrics(workdir, step, meta, is_main)
        ready()
        if step >= t.steps:
            checkpointer.close()
            return state, final_metrics(workdir, step)
        if is_main:
            truncate_after(workdir / "metrics.jsonl", step)
        print(f"resumed from step {step}")
    else:
        state = init()
        ready()
        if is_main and (workdir / "metrics.jsonl").exists():  # a run that died before its first checkpoint
            (workdir / "metrics.jsonl").replace(workdir / "metrics.jsonl.prev")
    step_fn = step_fn or run.bind(run.train_step(signature), frozen)
    seq = signature["inputs"].shape[-1]
    flops = flops_per_token or counts.flops_per_token(config.model, seq)
    peak, peak_source = peak_flops(config)
    writer = MetricsWriter(workdir, enabled=is_main)
    if not resume:
        writer.write(
            0,
            dict(first_row or {})
            | {"flops_per_token": flops, "peak_flops": peak}
            | (evaluate(state) if evaluate else {}),
        )
    spec = LoopSpec(
        t.steps,
        t.log_every,
        config.eval.every_steps,
        math.prod(signature["inputs"].shape),
        flops,
        peak,
        config.checkpoint.agree_every_steps,
        run.updates_per_step,
        measure_peak=None if t.peak_flops > 0 else lambda: peak_flops(config)[0],
    )
    with StopSignal() as stop:
        faults = Faults(FaultPolicy.from_config(t), stop, target, health)
        state, last = run_loop(
            spec,
            state,
            step_fn,
            data_iter,
            to_device,
            evaluate=evaluate,
            writer=writer,
            checkpointer=checkpointer,
            faults=faults,
            show_progress=show_progress and is_main,
        )
        checkpointer.close()  # a signal during the last save still lets it finish
    writer.close()
    revised = last.get("peak_flops_revised")  # the run beat the start-up figure (lm.train.loop._Peak)
    return state, last | {"peak_flops_source": f"{peak_source}; {revised}" if revised else peak_source}
