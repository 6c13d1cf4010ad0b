"""The one training loop: steps, throughput/MFU, periodic eval, metrics, checkpoints, faults.

Every training flavour hands it a jitted step and a data iterator; the loop itself
knows nothing about losses or models.

Metrics are read back one step late (the device runs step s+1 while the host checks
step s), except at log, eval and checkpoint steps, where everything is checked first:
a checkpoint is only written after its step was seen to be healthy.

Progress is a live bar on a terminal; when output goes to a log, a plain line per logged
step instead (a bar's carriage-return frames would fill the log).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Iterator

import jax
from tqdm import tqdm

from lm.data.progress import bars
from lm.errors import UserError
from lm.process import peers
from lm.train.faults import FaultPolicy, Health, StopSignal, agree_any
from lm.train.perf import mfu

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
    measure_peak: Callable[[], float] | None = None  # measures peak_flops again (None: a given figure)


@dataclasses.dataclass
class Faults:
    """The fault-handling parts of a run; all optional."""

    policy: FaultPolicy = dataclasses.field(default_factory=FaultPolicy)
    stop: StopSignal | None = None
    abstract_state: object = None  # restore target for rollbacks
    health: dict | None = None  # counters restored from a checkpoint


def _due(step: int, every: int, total: int) -> bool:
    return step == total or (every > 0 and step % every == 0)


class _Peak:
    """The peak FLOP/s that MFU divides by.

    A measured peak is only a lower bound on what the devices can do: measured in a slow spell
    or under load, the run beats it and MFU shows over 100%. Then it is measured once more and
    the larger figure kept; if the run still beats that, the achieved rate is the best evidence
    and becomes the peak (that window shows 100%). A given peak (train.peak_flops) is never revised.
    """

    def __init__(self, spec: LoopSpec):
        self.flops, self.spec, self.measure = spec.peak_flops, spec, spec.measure_peak
        self.remeasured, self.raised = None, None  # what happened, for the summary

    def mfu(self, step: int, tokens_per_s: float) -> tuple[float, bool]:
        """(MFU of a window, whether the peak was revised for it)."""
        achieved, before = tokens_per_s * self.spec.flops_per_token, self.flops
        if self.measure is None or achieved <= self.flops:
            return mfu(tokens_per_s, self.spec.flops_per_token, self.flops), False
        if self.remeasured is None:  # once per run: a measurement takes a second or more
            measured = self.measure()
            self.flops = max(self.flops, measured)
            self.remeasured = f"re-measured at step {step}: {measured / 1e9:.0f} GFLOP/s"
        if achieved > self.flops:
            self.flops = achieved
            self.raised = f"raised to the achieved {achieved / 1e9:.0f} GFLOP/s at step {step}"
        return mfu(tokens_per_s, self.spec.flops_per_token, self.flops), self.flops != before

    def figures(self) -> dict:
        revised = "; ".join(note for note in (self.remeasured, self.raised) if note)
        return {"peak_flops": self.flops} | ({"peak_flops_revised": revised} if revised else {})


class _Logger:
    """Throughput windows, metrics rows, and the progress bar (a terminal) or lines (a log)."""

    def __init__(self, spec: LoopSpec, writer, start: int, show: bool):
        self.spec, self.writer, self.peak = spec, writer, _Peak(spec)
        self.lines = show and not bars(show)
        self.bar = tqdm(
            total=spec.total_steps, initial=start, disable=not show or self.lines, unit="step", dynamic_ncols=True
        )
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
        timed = self.window_steps > 0
        if timed:
            row["tokens_per_s"] = self.window_steps * self.spec.tokens_per_step / (now - self.window_start)
        self._close_window(now)
        if timed:
            row["mfu"], revised = self.peak.mfu(step, row["tokens_per_s"])
            if revised:
                row["peak_flops"] = self.peak.flops
                self.pause()  # a measurement is not training time
        self.logged = row | {"compile_s": self.compile_s}
        self.write(step, self.logged)
        self.bar.set_postfix(_postfix(row), refresh=False)
        if self.lines:
            shown = ", ".join(f"{k} {v}" for k, v in _postfix(row).items())
            self.say(f"step {step}/{self.spec.total_steps}: {shown}")

    def say(self, text: str) -> None:
        """A line of its own (above the bar on a terminal), on disk at once in a log."""
        self.bar.write(text)
        sys.stdout.flush()

    def write(self, step: int, row: dict) -> None:
        if self.writer:
            self.writer.write(step, row)

    def flush(self) -> None:
        """Puts what the writer buffers on disk (after a checkpoint: a resume starts from there)."""
        if getattr(self.writer, "flush", None) is not None:
            self.writer.flush()

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
        return {
            "run_tokens_per_s": tps,
            "run_mfu": mfu(tps, self.spec.flops_per_token, self.peak.flops),
            "run_train_seconds": self.run_seconds,
            "run_timed_steps": self.run_steps,
        }


@peers.settling()  # multi-host: an error that a lost peer caused waits for the watchdog to name it
def run_loop(
    spec: LoopSpec,
    state,
    step_fn: Callable,
    data_iter: Iterator,
    to_device: Callable,
    *,
    evaluate: Callable | None = None,
    writer=None,
    checkpointer=None,
    faults: Faults | None = None,
    show_progress: bool = True,
):
    """Runs from state.step to spec.total_steps; returns (state, last logged and eval metrics).

    The returned dict holds `stopped_by` (a signal name) when a signal ended the run early.
    lm.process.peers.PROGRESS follows the last step checked and the checkpoints saved.
    """
    faults = faults or Faults()
    health = Health(faults.policy)
    if faults.health:
        health.load_state_dict(faults.health)
    step = int(jax.device_get(state.step)) // spec.updates_per_step
    peers.PROGRESS.started(step, getattr(checkpointer, "directory", None))
    log = _Logger(spec, writer, step, show_progress)
    pending, last_eval, stopped_by = [], {}, None
    while step < spec.total_steps:
        step += 1
        t0 = time.perf_counter()
        state, metrics = step_fn(state, to_device(next(data_iter)))
        log.stepped(t0, metrics)
        pending.append((step, metrics))
        stop, timed = _agreed_flags(spec, step, faults.stop, checkpointer)
        persist = checkpointer is not None and (checkpointer.due(step) or timed or stop or step == spec.total_steps)
        local = checkpointer is not None and not persist and checkpointer.local_due(step)
        ckpt_due = persist or local
        must_check = (
            ckpt_due
            or _due(step, spec.log_every, spec.total_steps)
            or (evaluate is not None and _due(step, spec.eval_every, spec.total_steps))
        )
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
            log.say(
                f"step {step}: "
                + ", ".join(
                    f"{k} {v:.4f}" for k, v in last_eval.items() if k in EVAL_SHOWN or k.endswith("/bits_per_byte")
                )
            )
            log.pause()
        if ckpt_due:
            checkpointer.save(step, state, data_iter, health=health.state_dict(), local_only=local)
            peers.PROGRESS.saving_started(step)
            log.flush()
            log.pause()
        if stop:
            stopped_by = faults.stop.received or "a signal on another process"
            break
    log.bar.close()
    return state, (
        log.logged
        | last_eval
        | log.run_figures()
        | log.peak.figures()
        | {"stopped_by": stopped_by, "stop_step": step}
        | health.metrics()
    )


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
        peers.PROGRESS.step = s
        if _due(s, spec.log_every, spec.total_steps) or verdict is not None:
            log.log(s, host | health.metrics())
        if verdict is not None:
            return verdict
    return None


def _handle(verdict, state, step: int, checkpointer, faults: Faults, health: Health, log: _Logger):
    """Rolls back to the newest checkpoint (the data iterator keeps going: the bad batches are
    skipped) or stops with the reason."""
    if verdict.action == "restore" and (
        checkpointer is None or faults.abstract_state is None or checkpointer.latest_step() is None
    ):
        verdict.reason += "; no checkpoint to roll back to yet"
        verdict.action = "stop"
    if verdict.action == "stop":
        log.bar.close()
        raise UserError(
            f"training stopped: {verdict.reason}; inspect the data near that step, or lower "
            "optim.lr, then --resume (train.on_bad=restore rolls back automatically)"
        )
    checkpointer.wait()
    del state  # free the bad state before the restored one arrives
    state, restored_step, _ = checkpointer.restore(faults.abstract_state)
    health.rolled_back()
    peers.PROGRESS.step = restored_step
    log.say(
        f"lm: warning: {verdict.reason}; rolled back to step {restored_step} and skipped the "
        f"{step - restored_step} batches since ({health.rollbacks} rollback(s) so far)"
    )
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
