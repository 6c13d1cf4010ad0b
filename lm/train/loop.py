"""The one training loop: steps, throughput/MFU, periodic eval, metrics, checkpoints, faults.

Every training flavour hands it a jitted step and a data iterator; the loop itself
knows nothing about losses or models.

Metrics are read back one step late (the device runs step s+1 while the host checks
step s), except at log, eval and checkpoint steps, where everything is checked first:
a checkpoint is only written after its step was seen to be healthy.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import jax
from tqdm import tqdm

from lm.errors import UserError
from lm.perf import mfu
from lm.train.faults import FaultPolicy, Health, StopSignal, agree_any


EVAL_SHOWN = ("eval_loss", "eval_reward")  # printed at each eval


@dataclasses.dataclass
class LoopSpec:
    total_steps: int
    log_every: int
    eval_every: int
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float
    agree_every: int = 1  # multi-host: steps between agreements on signals and timed saves
    updates_per_step: int = 1  # state.step counts updates; a step may make several (RL)


@dataclasses.dataclass
class Faults:
    """The fault-handling parts of a run; all optional."""
    policy: FaultPolicy = dataclasses.field(default_factory=FaultPolicy)
    stop: StopSignal | None = None
    abstract_state: object = None  # restore target for rollbacks
    health: dict | None = None  # counters restored from a checkpoint


def _due(step: int, every: int, total: int) -> bool:
    return step == total or (every > 0 and step % every == 0)


class _Logger:
    """Throughput windows, metrics rows and the progress bar."""

    def __init__(self, spec: LoopSpec, writer, start: int, show: bool):
        self.spec, self.writer = spec, writer
        self.bar = tqdm(total=spec.total_steps, initial=start, disable=not show, unit="step", dynamic_ncols=True)
        self.window_start, self.window_steps, self.compile_s, self.logged = None, 0, None, {}
        self.run_steps, self.run_seconds = 0, 0.0  # every timed window of the run, for its summary

    def stepped(self, t0: float, metrics) -> None:
        if self.window_start is None:  # the first step compiles: time it apart
            jax.block_until_ready(metrics)
            self.compile_s = time.perf_counter() - t0
            self.window_start, self.window_steps = time.perf_counter(), 0
        else:
            self.window_steps += 1
        self.bar.update(1)

    def log(self, step: int, row: dict) -> None:
        now = time.perf_counter()
        if self.window_steps:
            row["tokens_per_s"] = self.window_steps * self.spec.tokens_per_step / (now - self.window_start)
            row["mfu"] = mfu(row["tokens_per_s"], self.spec.flops_per_token, self.spec.peak_flops)
        self._close_window(now)
        self.logged = row | {"compile_s": self.compile_s}
        self.write(step, self.logged)
        self.bar.set_postfix(_postfix(row), refresh=False)

    def write(self, step: int, row: dict) -> None:
        if self.writer:
            self.writer.write(step, row)

    def pause(self) -> None:
        """Eval or checkpoint time is not training time: the next window starts now."""
        self.window_start, self.window_steps = time.perf_counter(), 0

    def close_window(self) -> None:
        self._close_window(time.perf_counter())

    def _close_window(self, now: float) -> None:
        if self.window_steps:
            self.run_steps += self.window_steps
            self.run_seconds += now - self.window_start
        self.window_start, self.window_steps = now, 0

    def run_figures(self) -> dict:
        """Throughput over every timed step of the run (all but the compiling first step)."""
        if not self.run_steps:
            return {}
        tps = self.run_steps * self.spec.tokens_per_step / self.run_seconds
        return {"run_tokens_per_s": tps, "run_mfu": mfu(tps, self.spec.flops_per_token, self.spec.peak_flops),
                "run_train_seconds": self.run_seconds, "run_timed_steps": self.run_steps}


def run_loop(spec: LoopSpec, state, step_fn: Callable, data_iter: Iterator, to_device: Callable, *,
             evaluate: Callable | None = None, writer=None, checkpointer=None, faults: Faults | None = None,
             show_progress: bool = True):
    """Runs from state.step to spec.total_steps; returns (state, last logged and eval metrics).

    The returned dict holds `stopped_by` (a signal name) when a signal ended the run early.
    """
    faults = faults or Faults()
    health = Health(faults.policy)
    if faults.health:
        health.load_state_dict(faults.health)
    step = int(jax.device_get(state.step)) // spec.updates_per_step
    log = _Logger(spec, writer, step, show_progress)
    pending, last_eval, stopped_by = [], {}, None
    while step < spec.total_steps:
        step += 1
        t0 = time.perf_counter()
        state, metrics = step_fn(state, to_device(next(data_iter)))
        log.stepped(t0, metrics)
        pending.append((step, metrics))
        stop, timed = _agreed_flags(spec, step, faults.stop, checkpointer)
        ckpt_due = checkpointer is not None and (checkpointer.due(step) or timed or stop or step == spec.total_steps)
        must_check = ckpt_due or _due(step, spec.log_every, spec.total_steps) or \
            (evaluate is not None and _due(step, spec.eval_every, spec.total_steps))
        verdict = _check(pending, health, log, spec, upto=step if must_check else step - 1)
        if verdict is not None:
            state, step = _handle(verdict, state, step, checkpointer, faults, health, log)
            pending.clear()
            continue
        if must_check:  # the device finished this step: close the timed window before other work
            log.close_window()
        if evaluate is not None and _due(step, spec.eval_every, spec.total_steps):
            last_eval = evaluate(state)
            log.write(step, last_eval)
            log.bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()
                                                        if k in EVAL_SHOWN or k.endswith("/bits_per_byte")))
            log.pause()
        if ckpt_due:
            checkpointer.save(step, state, data_iter, health=health.state_dict())
            log.pause()
        if stop:
            stopped_by = faults.stop.received or "a signal on another process"
            break
    log.bar.close()
    return state, (log.logged | last_eval | log.run_figures() | {"stopped_by": stopped_by, "stop_step": step}
                   | health.metrics())


def _agreed_flags(spec: LoopSpec, step: int, stop: StopSignal | None, checkpointer) -> tuple[bool, bool]:
    """(stop now, timed save now): host-local facts, made common to all processes."""
    if jax.process_count() > 1 and step % spec.agree_every and step != spec.total_steps:
        return False, False
    local_stop = stop is not None and stop.received is not None
    local_timed = checkpointer is not None and checkpointer.time_due()
    agreed = agree_any([local_stop, local_timed])
    return agreed[0], agreed[1]


def _check(pending: list, health: Health, log: _Logger, spec: LoopSpec, upto: int):
    """Feeds the metrics of steps <= upto to Health (and the log); returns the first Verdict."""
    while pending and pending[0][0] <= upto:
        s, metrics = pending.pop(0)
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        verdict = health.observe(s, host["loss"], host.get("update_skipped", 0.0) > 0)
        if _due(s, spec.log_every, spec.total_steps) or verdict is not None:
            log.log(s, host | health.metrics())
        if verdict is not None:
            return verdict
    return None


def _handle(verdict, state, step: int, checkpointer, faults: Faults, health: Health, log: _Logger):
    """Rolls back to the newest checkpoint (the data iterator keeps going: the bad batches are
    skipped) or stops with the reason."""
    if verdict.action == "restore" and (checkpointer is None or faults.abstract_state is None
                                        or checkpointer.latest_step() is None):
        verdict.reason += "; no checkpoint to roll back to yet"
        verdict.action = "stop"
    if verdict.action == "stop":
        log.bar.close()
        raise UserError(f"training stopped: {verdict.reason}; inspect the data near that step, or lower "
                        "optim.lr, then --resume (train.on_bad=restore rolls back automatically)")
    checkpointer.wait()
    del state  # free the bad state before the restored one arrives
    state, restored_step, _ = checkpointer.restore(faults.abstract_state)
    health.rolled_back()
    log.bar.write(f"lm: warning: {verdict.reason}; rolled back to step {restored_step} and skipped the "
                  f"{step - restored_step} batches since ({health.rollbacks} rollback(s) so far)")
    log.write(step, {"rollback_to": restored_step} | health.metrics())
    log.bar.n = restored_step
    log.pause()
    return state, restored_step


def _postfix(row: dict) -> dict:
    out = {"loss": f"{row['loss']:.3f}"}
    if "tokens_per_s" in row:
        out["tok/s"] = f"{row['tokens_per_s']:.0f}"
        out["mfu"] = f"{100 * row['mfu']:.1f}%"
    return out
