"""Multi-host runs: every process joins within a bound, and a lost process ends every other one
with one line that says how to go on.

Left alone, JAX ends the survivors of a lost process with a C++ abort and no advice: after its
heartbeat timeout, or at once when the lost one is process 0 (it hosts the coordination service
the others talk to). Here instead:

- joining is timed (--startup-timeout): a process that waited in vain says for whom;
- a watchdog on every process beats through the coordination service's key-value store and ends
  the process (one `lm:` line, exit 75) once a peer has been silent, or the coordinator has not
  answered, for --peer-timeout seconds. JAX's own heartbeat is set longer, so ours speaks first;
- processes other than 0 reach the coordinator through a local relay: when process 0 is gone the
  relay keeps their connection open and silent, so JAX's client waits instead of aborting;
- a runtime error (a collective whose peer is gone fails at once) waits for the watchdog's verdict
  before it is shown: the line names the lost process, not a broken socket.

The training loop keeps `PROGRESS` up to date: the line names the last step and the checkpoint to
resume from. Nothing here imports jax before `start` (verbs build their parsers without it).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pathlib
import socket
import sys
import threading
import time

EXIT_LOST = 75  # EX_TEMPFAIL: the run goes on (again, or with --resume) once every process is back
BEATS, EXITS = "lm_peers/beat/", "lm_peers/exit/"  # keys in the coordination service's key-value store
MARGIN_S = 30  # JAX's own checks (joining, heartbeats) fire at least this long after ours
EXIT_WAIT_S = 300  # at exit, how long to wait for the others (JAX's shutdown barrier waits as long)


@dataclasses.dataclass
class Progress:
    """What training has reached on this process: the training loop sets it."""

    step: int | None = None  # the last step this process completed (None: training has not begun)
    saved: int | None = None  # the newest checkpoint known to be whole (saved, or resumed from)
    saving: int | None = None  # a checkpoint whose asynchronous write may still be running
    directory: pathlib.Path | None = None  # where checkpoints are: a finished write is DIRECTORY/STEP

    def started(self, step: int, directory) -> None:
        """The loop starts at `step`: a step above 0 was restored from its checkpoint."""
        self.step, self.directory = None, pathlib.Path(directory) if directory is not None else None
        self.saved, self.saving = (step if step > 0 else None), None

    def saving_started(self, step: int) -> None:
        """A save of `step` began; it waited for the previous one, which is whole now."""
        self.saved, self.saving = (self.saving if self.saving is not None else self.saved), step

    def newest(self) -> int | None:
        if self.saving is not None and self.directory is not None and (self.directory / str(self.saving)).is_dir():
            return self.saving
        return self.saved


PROGRESS = Progress()


@dataclasses.dataclass(frozen=True)
class Launch:
    """The command's multi-host settings, and what its advice depends on."""

    startup_s: float
    peer_s: float
    resumable: bool  # a training command: --resume continues it from its newest checkpoint
    resumed: bool  # it was started with --resume


_WATCHDOG: "_Watchdog | None" = None
_ENDING = threading.Lock()


def start(coordinator: str | None, num_processes: int | None, process_id: int | None, launch: Launch) -> None:
    """jax.distributed.initialize, ended with one line when not every process joined within
    launch.startup_s; then the watchdog. A no-op when already initialized."""
    import jax

    global _WATCHDOG
    if jax.distributed.is_initialized():
        return
    coordinator, num_processes, process_id = _detected(coordinator, num_processes, process_id, launch.startup_s)
    relay = _Relay(coordinator) if coordinator and process_id not in (None, 0) else None
    joined = threading.Event()
    threading.Thread(
        target=_expire,
        args=(joined, launch, coordinator, num_processes, process_id, relay),
        daemon=True,
        name="lm-join",
    ).start()
    try:
        jax.distributed.initialize(
            relay.address if relay else coordinator,
            num_processes,
            process_id,
            initialization_timeout=int(launch.startup_s) + MARGIN_S,
            heartbeat_timeout_seconds=int(2 * (launch.peer_s + MARGIN_S)),
        )
    finally:
        joined.set()
    from jax._src.distributed import global_state

    _WATCHDOG = _Watchdog(global_state.client, global_state.process_id, global_state.num_processes, launch, relay)
    sys.excepthook = _settling_hook(sys.excepthook)
    atexit.register(_WATCHDOG.exiting)  # registered after jax's own: runs before its shutdown barrier


def settle(error: BaseException | None) -> None:
    """Called before `error` is shown: a runtime error of a multi-process run may come from a collective
    whose peer is gone. Waits until the watchdog names that peer (it ends the process), or every peer
    has been seen alive since (the error is this process's own)."""
    if _WATCHDOG is not None and _runtime_error(error):
        _WATCHDOG.wait_for_signs_of_life()


@contextlib.contextmanager
def settling():
    """Calls `settle` on an error leaving the block (or the function it decorates)."""
    try:
        yield
    except Exception as error:
        settle(error)
        raise


def _settling_hook(previous):
    def hook(kind, value, traceback):
        settle(value)
        previous(kind, value, traceback)

    return hook


def _runtime_error(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is an error of JAX's runtime."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(c.__name__ in ("JaxRuntimeError", "XlaRuntimeError") for c in type(error).__mro__):
            return True
        error = error.__cause__ or error.__context__
    return False


def end(line: str) -> None:
    """Prints `line` alone on stderr and ends the process at once, from any thread: no interpreter
    teardown, which would wait for the lost peer (JAX's shutdown barrier, a stuck collective)."""
    with _ENDING:  # a second caller waits here until the process is gone
        try:
            sys.stdout.flush()
            sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line + "\n")  # below a progress bar
            sys.stderr.flush()
        finally:
            os._exit(EXIT_LOST)


# ---- joining -------------------------------------------------------------------------------------


def _detected(coordinator: str | None, n: int | None, me: int | None, timeout: float):
    """The coordinator, process count and index that JAX would detect where they are not given
    (TPU pods, Slurm, Open MPI): the relay needs them before JAX does. Unchanged when none is found."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if None not in (coordinator, n, me):
        return coordinator, n, me
    try:
        from jax._src.clusters import ClusterEnv

        found = ClusterEnv.auto_detect_unset_distributed_params(coordinator, n, me, None, None, int(timeout))
        return found[0], found[1], found[2]
    except Exception:  # a JAX without this helper: it detects them itself, without the relay
        return coordinator, n, me


def _expire(
    joined: threading.Event, launch: Launch, coordinator: str | None, n: int | None, me: int | None, relay
) -> None:
    if not joined.wait(launch.startup_s):
        end(_not_joined(launch.startup_s, coordinator, n, me, relay))


def _not_joined(waited_s: float, coordinator: str | None, n: int | None, me: int | None, relay) -> str:
    waited = f"within {waited_s:g} s (--startup-timeout)"
    at = coordinator or "the coordinator"
    if relay is not None and relay.lost:
        return (
            f"lm: lost process 0 (the coordinator at {at}) while joining; run the same command again on every process"
        )
    if relay is not None and not relay.reached:
        return (
            f"lm: process 0 (the coordinator at {at}) did not answer {waited}; start it (the same command "
            "with --process-id 0), or check --coordinator"
        )
    if me == 0 and n:
        missing = "process 1 of 2" if n == 2 else f"some of processes 1-{n - 1} (of {n})"
    else:
        missing = "some of the processes"
    return (
        f"lm: {missing} did not join {waited}; start every process with the same command and its own "
        f"--process-id, and check that each one reaches {at}"
    )


# ---- after joining -------------------------------------------------------------------------------


class _Watchdog:
    """Beats through the coordination service's key-value store; ends the process when a peer's beat
    has not changed, or the coordinator has not answered, for launch.peer_s. Two threads: a call to a
    coordinator that is gone hangs (the relay keeps it open), and the judging must go on."""

    def __init__(self, client, me: int, n: int, launch: Launch, relay):
        self.client, self.me, self.n, self.launch, self.relay = client, me, n, launch, relay
        self.interval = min(max(launch.peer_s / 10, 0.2), 5.0)
        now = time.monotonic()
        self.answered = now  # the last time the coordinator answered a beat
        self.changed = {p: now for p in range(n) if p != me}  # when each peer's beat last changed here
        self.beats: dict[int, str] = {}
        self.stopped = False  # every process is exiting: the coordinator may shut down now
        for target in (self._beat, self._watch):
            threading.Thread(target=target, daemon=True, name="lm-peers").start()

    def exiting(self) -> None:
        """At exit, before JAX's shutdown barrier: waits (still watching) until every process exits
        too, then stands down, so that the coordinator shutting down is not taken for a loss."""
        try:
            self.client.key_value_set(f"{EXITS}{self.me}", "1")
            deadline = time.monotonic() + EXIT_WAIT_S
            while len(self.client.key_value_dir_get(EXITS)) < self.n and time.monotonic() < deadline:
                time.sleep(self.interval)
        except (Exception, KeyboardInterrupt):  # the service failed (JAX's shutdown says so), or Ctrl-C: out
            pass
        self.stopped = True

    def _beat(self) -> None:
        count = 0
        while not self.stopped:
            count += 1
            try:
                self.client.key_value_set(f"{BEATS}{self.me}", str(count), allow_overwrite=True)
                self._saw(self.client.key_value_dir_get(BEATS))
            except Exception:  # the service is unreachable: `_watch` judges the silence
                pass
            time.sleep(self.interval)

    def wait_for_signs_of_life(self) -> None:
        """Returns once every peer has beaten twice more (a lost one beats once more at most: a beat
        written just before it was lost and read after), or after peer_s and the watchdog's turn."""
        since, before = time.monotonic(), dict(self.beats)
        deadline = since + self.launch.peer_s + 3 * self.interval
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            alive = all(int(self.beats.get(p, 0)) >= int(before.get(p, 0)) + 2 for p in self.changed)
            if alive and (self.me == 0 or self.answered > since):
                return

    def _saw(self, beats) -> None:
        now = time.monotonic()
        self.answered = now
        for key, value in beats:
            p = int(key.rsplit("/", 1)[-1])
            if p in self.changed and self.beats.get(p) != value:
                self.beats[p], self.changed[p] = value, now

    def _watch(self) -> None:
        while not self.stopped:
            time.sleep(self.interval)
            lost = self.lost()
            if lost is not None and not self.stopped:
                end(_line(*lost, self.me, self.n, self.launch))

    def lost(self) -> tuple[int, float] | None:
        """(the lost process, how long it has been silent), or None."""
        now = time.monotonic()
        if self.me != 0 and now - self.answered > self.launch.peer_s:
            return 0, now - self.answered
        for p, since in self.changed.items():
            if now - since > self.launch.peer_s:
                return p, now - since
        return None


def _line(who: int, silent: float, me: int, n: int, launch: Launch) -> str:
    """The one line that ends a process whose peer `who` was lost."""
    how = "no answer" if who == 0 and me != 0 else "silent"
    what = f"process {who} of {n}" + (" (the coordinator)" if who == 0 else "")
    said = [
        f"lm: lost {what}: {how} for {silent:.0f} s (--peer-timeout {launch.peer_s:g})",
        _reached(me, launch),
        _advice(launch),
    ]
    return "; ".join(s for s in said if s)


def _reached(me: int, launch: Launch) -> str:
    if PROGRESS.step is not None:
        return f"this process ({me}) completed step {PROGRESS.step}"
    if launch.resumable:
        return f"this process ({me}) had not {'resumed' if launch.resumed else 'begun'} training"
    return ""


def _advice(launch: Launch) -> str:
    """A command that works from here: every process restarts together."""
    newest = PROGRESS.newest()
    if not launch.resumable:
        return "run the same command again on every process"
    if newest is not None:
        return f"resume from checkpoint step {newest}: run the same command on every process with --resume"
    if launch.resumed:
        return "resume from the newest checkpoint: run the same command again on every process (with --resume)"
    return "no checkpoint yet: run the same command again on every process (without --resume)"


# ---- the relay -----------------------------------------------------------------------------------


class _Relay:
    """A local TCP relay to the coordinator, for a process other than 0. When the coordinator's end
    closes, the local end stays open and silent: JAX's client waits for an answer (up to its
    heartbeat timeout) instead of aborting at once, and the watchdog names process 0 first."""

    def __init__(self, coordinator: str):
        host, port = coordinator.rsplit(":", 1)
        self.upstream = (host.strip("[]"), int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.reached = False  # the coordinator accepted a connection
        self.lost = False  # the coordinator closed one
        threading.Thread(target=self._accept, daemon=True, name="lm-relay").start()

    def _accept(self) -> None:
        while True:
            local, _ = self.server.accept()
            threading.Thread(target=self._serve, args=(local,), daemon=True, name="lm-relay").start()

    def _serve(self, local: socket.socket) -> None:
        try:
            remote = socket.create_connection(self.upstream, timeout=10)
        except OSError:  # not listening (yet): JAX's client retries, as it would without the relay
            local.close()
            return
        remote.settimeout(None)
        self.reached = True
        closed = threading.Event()  # the local end closed first
        threading.Thread(target=self._down, args=(remote, local, closed), daemon=True, name="lm-relay").start()
        _copy(local, remote)
        closed.set()
        for s in (remote, local):
            _close(s)

    def _down(self, remote: socket.socket, local: socket.socket, closed: threading.Event) -> None:
        _copy(remote, local)
        if not closed.is_set():
            self.lost = True


def _copy(source: socket.socket, target: socket.socket) -> None:
    """Copies until `source` ends; once `target` fails, what `source` sends is dropped."""
    open_ = True
    while True:
        try:
            data = source.recv(1 << 16)
        except OSError:
            return
        if not data:
            return
        if open_:
            try:
                target.sendall(data)
            except OSError:
                open_ = False


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it
    except OSError:
        pass
    s.close()
