"""The wiring every training stage shares, after its data is ready: checkpoints (fresh start or
exact resume), the jitted step, held-out evaluation, metrics, MFU, signals and faults, the loop.

A stage (pretraining, SFT, ...) builds its run (lm.train.setup), its data iterator and its
evaluation, then calls `fit`; what it does before and after is its own.
"""

from __future__ import annotations

import math
import pathlib
from typing import Callable

import jax

from lm import plan
from lm.errors import UserError
from lm.perf import measure_matmul_peak
from lm.store.checkpoint import Checkpointer, saved_steps
from lm.train.faults import FaultPolicy, StopSignal
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.metrics import MetricsWriter, truncate_after
from lm.train.steps import summarize


def check_resume(directory: pathlib.Path, resume: bool, total_steps: int) -> int | None:
    """--resume needs a checkpoint and a fresh run must not find one: checked before any data work.

    Returns the final step when the run already reached `total_steps` (nothing left to do).
    """
    steps = saved_steps(directory)
    if resume and not steps:
        raise UserError(f"--resume: no checkpoint in '{directory}'; run without --resume to start fresh")
    if not resume and steps:
        raise UserError(f"'{directory.parent}' already holds checkpoints (steps {steps[0]}..{steps[-1]}); "
                        "pass --resume to continue, or use a new --workdir")
    return steps[-1] if resume and steps[-1] >= total_steps else None


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
    return per_device * n, (f"measured at start-up: a 2048^3 {config.model.compute_dtype} matmul on one device "
                            f"({per_device / 1e9:.0f} GFLOP/s) x {n} device(s); set train.peak_flops to the "
                            "vendor's figure for a stable MFU")


def fit(run, workdir, data_iter, *, resume: bool, init: Callable, evaluate: Callable | None = None,
        first_row: dict | None = None, frozen=None, signature: dict | None = None,
        show_progress: bool = True, flops_per_token: float | None = None, step_fn: Callable | None = None):
    """Trains `run` from a fresh `init()` state (or the newest checkpoint when resuming) to
    config.train.steps. Returns (state, last) where last holds the final logged and eval metrics,
    run throughput, `stopped_by` (a signal's name when one ended the run early) and the peak.

    first_row: step-0 metrics of a fresh run (evaluate(state) is added to it).
    flops_per_token: for MFU (default: the trained model's, lm.plan.flops_per_token).
    step_fn: `step(state, host batch) -> (state, metrics)` of a stage whose step is more than the
    jitted update (RL: rollouts, rewards, several updates); it places its own data, and
    `signature` then describes the rows its updates see (for tokens/s).
    """
    config, workdir = run.config, pathlib.Path(workdir)
    t, is_main = config.train, jax.process_index() == 0
    signature = signature or run.signature()
    to_device = (lambda batch: batch) if step_fn is not None else run.placer(signature)
    checkpointer = Checkpointer.from_config(workdir / "checkpoints", config)
    target = run.abstract_state()
    health = None
    if resume:
        state, step, meta = checkpointer.restore(target, data_iter)
        health = meta.get("health")
        if is_main:
            truncate_after(workdir / "metrics.jsonl", step)
        print(f"resumed from step {step}")
    else:
        state = init()
        if is_main and (workdir / "metrics.jsonl").exists():  # a run that died before its first checkpoint
            (workdir / "metrics.jsonl").replace(workdir / "metrics.jsonl.prev")
    step_fn = step_fn or run.bind(run.train_step(signature), frozen)
    seq = signature["inputs"].shape[-1]
    flops = flops_per_token or plan.flops_per_token(config.model, seq)
    peak, peak_source = peak_flops(config)
    writer = MetricsWriter(workdir, enabled=is_main)
    if not resume:
        writer.write(0, dict(first_row or {}) | {"flops_per_token": flops, "peak_flops": peak} |
                     (evaluate(state) if evaluate else {}))
    spec = LoopSpec(t.steps, t.log_every, config.eval.every_steps, math.prod(signature["inputs"].shape), flops, peak,
                    config.checkpoint.agree_every_steps, run.updates_per_step)
    with StopSignal() as stop:
        faults = Faults(FaultPolicy.from_config(t), stop, target, health)
        state, last = run_loop(spec, state, step_fn, data_iter, to_device, evaluate=evaluate, writer=writer,
                               checkpointer=checkpointer, faults=faults, show_progress=show_progress and is_main)
        checkpointer.close()  # a signal during the last save still lets it finish
    writer.close()
    return state, last | {"peak_flops": peak, "peak_flops_source": peak_source}
