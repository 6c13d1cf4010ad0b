"""What the loop does when something goes wrong: signals, non-finite steps, loss spikes.

- SIGTERM/SIGINT are handled from the start of a training command (lm.cli) to its end. In the
  training loop they set a flag: the loop finishes the step, saves and exits (a second SIGINT
  interrupts at once). Anywhere else (data preparation, a reference pass, the end-of-run
  evaluation) there is nothing to save: the run stops at once with `StopRequested`.
- Non-finite steps are already skipped inside the jitted step; `Health` counts them and,
  after `max_bad_steps` in a row or on a loss spike, asks the loop to roll back or stop.
- On several processes every decision taken from host-local facts (a signal, the clock)
  goes through `agree_any`, so all processes stop or save at the same step.
- A process forked while the handlers are installed (a worker) leaves stopping to the one that
  installed them: it ignores SIGINT and ends quietly on SIGTERM (what its parent sends it).
- A command stopped outside a loop may leave XLA compiling on its threads: it ends with
  `hard_exit` (output flushed, no interpreter teardown under XLA's feet).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import sys

import numpy as np


class StopRequested(KeyboardInterrupt):
    """A signal stopped a run outside its training loop, where stopping loses nothing. `saved`:
    the training is in its final checkpoint (--resume does the rest); else run the command again.
    A KeyboardInterrupt: what cleans up after Ctrl-C cleans up after it, and no `except Exception`
    takes it for a fault of its own (a damaged cache entry or checkpoint)."""

    def __init__(self, by: str, phase: str, saved: bool):
        lost = "the training is saved in its checkpoints" if saved else "nothing is lost"
        super().__init__(f"stopped by {by} during {phase}; {lost}")
        self.by, self.phase, self.saved = by, phase, saved


class StopSignal:
    """Context manager: SIGTERM/SIGINT request a clean stop instead of killing the process.

    Entered once for a whole command (lm.cli) or a stage (lm.train.stage); entering again while
    one is active returns that one, so a signal is never lost between phases. A run moves
    through named phases (`enter`): in a deferring one (the training loop) a signal only sets
    `received`, and the loop stops at its next step with a checkpoint; in any other it raises
    StopRequested at once. A fresh one defers (a bare `with StopSignal()` around a loop).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    active: "StopSignal | None" = None  # the one whose handlers are installed

    def __init__(self, phase: str = "training", defer: bool = True, saved: bool = True):
        self.received: str | None = None
        self.phase, self.defer, self.saved = phase, defer, saved
        self._previous = {}
        self._outer: StopSignal | None = None
        self._pid = os.getpid()  # the process whose handlers these are (set again on entering)

    def enter(self, phase: str, defer: bool = False, saved: bool = False) -> None:
        """Begins `phase` (saved: a stop there keeps the training, in its checkpoints). A safe point
        too: a signal received in a deferring phase that nothing acted on stops the run here."""
        if self.received is not None:
            raise StopRequested(self.received, self.phase, self.saved)
        self.phase, self.defer, self.saved = phase, defer, saved
        if StopSignal.active is self:  # again: jax.distributed.initialize puts its own SIGTERM handler in
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a forked worker: its parent stops it
            if signum != signal.SIGINT:
                hard_exit(128 + signum)
            return
        if self.received is not None and not self.defer:  # stopping already, and signalled again: out now
            print("lm: interrupted", file=sys.stderr)
            hard_exit(128 + signum)
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user really wants out now
        name = signal.Signals(signum).name
        self.received = self.received or name
        if not self.defer:
            raise StopRequested(name, self.phase, self.saved)
        print(f"lm: {name} received; finishing the current step and saving a checkpoint", flush=True)

    def __enter__(self) -> "StopSignal":
        if StopSignal.active is not None:
            self._outer = StopSignal.active
            return self._outer
        self._pid = os.getpid()
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        StopSignal.active = self
        return self

    def _unraisable(self, unraisable) -> None:
        """A stop raised where Python must drop it (a gc callback, e.g. jax's) is not printed as a
        traceback: `received` keeps it, and the next phase (a safe point) stops the run."""
        if not isinstance(unraisable.exc_value, StopRequested):
            self._previous_hook(unraisable)

    def __exit__(self, *exc):
        if self._outer is not None:
            self._outer = None
            return False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        sys.unraisablehook = self._previous_hook
        StopSignal.active = None
        return False


def hard_exit(code: int) -> None:
    """Ends the process now with `code`, its output flushed: no interpreter teardown, which would
    free XLA's client while a compilation a stop interrupted still runs on its threads (a crash)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can be said
            pass
    os._exit(code)


def agree_any(flags: list[bool]) -> list[bool]:
    """Element-wise OR of `flags` over all processes (one tiny allgather; free on one process)."""
    import jax  # here: the CLI installs StopSignal before jax may be imported

    if jax.process_count() == 1:
        return [bool(f) for f in flags]
    from lm.sharding import to_host

    gathered = to_host(np.asarray(flags, np.int32)[None])  # [processes, flags]
    return [bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).max(axis=0)]


@dataclasses.dataclass(frozen=True)
class FaultPolicy:
    max_bad_steps: int = 5
    on_bad: str = "restore"  # or "stop"
    spike_window: int = 0  # 0: no spike detection
    spike_threshold: float = 8.0
    max_rollbacks: int = 3

    @classmethod
    def from_config(cls, train_cfg) -> "FaultPolicy":
        return cls(**{f.name: train_cfg[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Verdict:
    """A reason to leave the normal path: `action` is 'restore' or 'stop'."""

    action: str
    reason: str


def robust_spike(window, loss: float, k: float) -> tuple[bool, float, float]:
    """loss > median + k * 1.4826 * MAD (the MAD scaled to a normal std), with a floor on the
    spread so a perfectly flat window does not flag tiny wiggles. Returns (spike, median, std)."""
    values = np.asarray(window, np.float64)
    median = float(np.median(values))
    std = 1.4826 * float(np.median(np.abs(values - median)))
    std = max(std, 1e-3 * max(abs(median), 1e-6))
    return loss > median + k * std, median, std


class Health:
    """Host-side counters over the per-step metrics; their state goes into every checkpoint."""

    def __init__(self, policy: FaultPolicy):
        self.policy = policy
        self.skipped_steps = 0
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.losses = collections.deque(maxlen=max(policy.spike_window, 1))

    def observe(self, step: int, loss: float, skipped: bool) -> Verdict | None:
        p = self.policy
        if skipped:
            self.skipped_steps += 1
            self.consecutive_bad += 1
            if self.consecutive_bad >= p.max_bad_steps:
                return self._verdict(
                    f"{self.consecutive_bad} consecutive steps with non-finite loss or "
                    f"gradients (train.max_bad_steps={p.max_bad_steps}), the last at step {step}"
                )
            return None
        self.consecutive_bad = 0
        if p.spike_window and len(self.losses) == p.spike_window:
            spike, median, std = robust_spike(self.losses, loss, p.spike_threshold)
            if spike:
                return self._verdict(
                    f"loss spike at step {step}: {loss:.4f} > median {median:.4f} + "
                    f"{p.spike_threshold:g} x robust std {std:.4f} over the last "
                    f"{p.spike_window} steps (train.spike_window, train.spike_threshold)"
                )
        self.losses.append(loss)
        return None

    def _verdict(self, reason: str) -> Verdict:
        if self.policy.on_bad == "restore" and self.rollbacks < self.policy.max_rollbacks:
            return Verdict("restore", reason)
        if self.policy.on_bad == "restore":
            reason += f"; already rolled back {self.rollbacks} times (train.max_rollbacks)"
        return Verdict("stop", reason)

    def rolled_back(self) -> None:
        """After a rollback the streak is over; the spike window keeps its history."""
        self.rollbacks += 1
        self.consecutive_bad = 0

    def metrics(self) -> dict:
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_bad": self.consecutive_bad,
            "rollbacks": self.rollbacks,
        }

    def state_dict(self) -> dict:
        return self.metrics() | {"losses": list(self.losses)}

    def load_state_dict(self, d: dict) -> None:
        self.skipped_steps, self.consecutive_bad = d["skipped_steps"], d["consecutive_bad"]
        self.rollbacks = d["rollbacks"]
        self.losses.clear()
        self.losses.extend(d["losses"])
