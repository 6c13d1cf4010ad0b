"""The one training loop: steps, throughput/MFU, periodic eval, metrics, checkpoints.

Every training flavour hands it a jitted step and a data iterator; the loop itself
knows nothing about losses or models.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import jax
from tqdm import tqdm

from lm.perf import mfu


@dataclasses.dataclass
class LoopSpec:
    total_steps: int
    log_every: int
    eval_every: int
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float


def _due(step: int, every: int, total: int) -> bool:
    return step == total or (every > 0 and step % every == 0)


def run_loop(spec: LoopSpec, state, step_fn: Callable, data_iter: Iterator, to_device: Callable, *,
             evaluate: Callable | None = None, writer=None, checkpointer=None, show_progress: bool = True):
    """Runs from state.step to spec.total_steps; returns (state, last logged and eval metrics)."""
    start = int(jax.device_get(state.step))
    bar = tqdm(total=spec.total_steps, initial=start, disable=not show_progress, unit="step",
               dynamic_ncols=True)
    window_start, window_steps, logged, compile_s, last_eval = None, 0, {}, None, {}
    for step in range(start + 1, spec.total_steps + 1):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, to_device(next(data_iter)))
        if window_start is None:  # the first step compiles: time it apart
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - t0
            window_start, window_steps = time.perf_counter(), 0
        else:
            window_steps += 1
        if _due(step, spec.log_every, spec.total_steps):
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            if window_steps:
                row["tokens_per_s"] = window_steps * spec.tokens_per_step / (now - window_start)
                row["mfu"] = mfu(row["tokens_per_s"], spec.flops_per_token, spec.peak_flops)
            window_start, window_steps = now, 0
            logged = row | {"compile_s": compile_s}
            if writer:
                writer.write(step, logged)
            bar.set_postfix(_postfix(row), refresh=False)
        if evaluate is not None and _due(step, spec.eval_every, spec.total_steps):
            eval_row = last_eval = evaluate(state)
            if writer:
                writer.write(step, eval_row)
            bar.write(f"step {step}: held-out loss {eval_row['eval_loss']:.4f}")
            window_start, window_steps = time.perf_counter(), 0  # eval time is not training time
        if checkpointer is not None:
            checkpointer.save(step, state, data_iter, force=step == spec.total_steps)
        bar.update(1)
    bar.close()
    return state, logged | last_eval


def _postfix(row: dict) -> dict:
    out = {"loss": f"{row['loss']:.3f}"}
    if "tokens_per_s" in row:
        out["tok/s"] = f"{row['tokens_per_s']:.0f}"
        out["mfu"] = f"{100 * row['mfu']:.1f}%"
    return out
