"""The fault drill's lost-host case (bench/fault_drill.py): the pretrain stage's tiny run as a
multi-host run of two processes x 4 simulated CPU devices on localhost (mesh data=2, fsdp=4).

  - one uninterrupted two-process run (the reference);
  - the same run with process 1 SIGKILLed once a checkpoint exists: process 0 must end with one
    `lm: lost process 1 of 2` line naming the checkpoint to resume from, exit 75 within
    --peer-timeout + SLACK_S of the kill, and print no traceback and no C++ stack; both resume;
  - process 0 (the coordinator) SIGKILLed later in the resumed run: the same, naming process 0;
    both resume (from the step the line named) to the end;
  - a process SIGKILLed during start-up (process 0 in one run, process 1 in another): the other
    names it in one start-up line and exits non-zero within --startup-timeout + SLACK_S;
and the final run's logged values (timings aside) and params must equal the reference's bitwise.
"""

from __future__ import annotations

import pathlib
import re
import signal
import socket
import time

from fault_drill_parts import (
    Child,
    child_env,
    final_params,
    logged_step,
    metric_rows,
    same_bits,
    saved_steps,
    traceback_line,
    values_by_step,
)
from fault_drill_stages import EVERY, STEPS, Inputs, stage_command

PEER_S, STARTUP_S, SLACK_S = 10, 20, 30
DEVICES = 4  # per process: the mesh below spans both processes' 8
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=4"]
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
KILL_AT = (2 * EVERY + 2, STEPS - 2 * EVERY)  # steps the two mid-run kills wait for (with a checkpoint before)
LOST = re.compile(
    r"^lm: lost process (\d) of 2(?: \(the coordinator\))?: (?:silent|no answer) for (\d+) s "
    rf"\(--peer-timeout {PEER_S}\); this process \((\d)\) (?:completed step (\d+)|had not \S+ training); "
    r"(?:resume from checkpoint step (\d+): run the same command on every process with --resume"
    r"|no checkpoint yet.*|resume from the newest checkpoint.*)$"
)
STARTUP = re.compile(
    r"^lm: (?:process (\d) of 2 did not join|process (\d) \(the coordinator at [^)]*\) did not "
    r"answer|lost process (\d) \(the coordinator at [^)]*\) while joining)"
)
# What must not reach the output of a process that ends itself: a Python traceback, a C++ check
# failure or abort, an absl fatal or error log line (`F1127 20:46:35.123 ...` / `E1127 ...`).
CRASH = re.compile(
    r"Traceback \(most recent call last\)|Check fail|terminate called|\*\*\* |"
    r"^[FE]\d{4} \d\d:\d\d:\d\d",
    re.M,
)
COLUMNS = [
    ("case", 42),
    ("survivor line (resume from)", 14),
    ("exit code", 6),
    ("seconds to exit", 8),
    ("bound s", 7),
    ("no crash output", 8),
    ("resume exact", 8),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LostHostDrill:
    def __init__(self, inp: Inputs, root: pathlib.Path, timeout: float):
        self.root, self.timeout = root, timeout
        self.command = [*stage_command("pretrain", inp), *MESH, "--peer-timeout", str(PEER_S)]
        self.reference, self.workdir = root / "reference", root / "drill"
        (root / "logs").mkdir(parents=True)
        self.env = child_env(root / "cache") | {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES} {FAST_COMPILE}"
        }
        self.n_logs = 0
        self.rows: list[list[str]] = []
        self.problems: list[str] = []
        self.notes: list[str] = []

    def launch(self, workdir: pathlib.Path, label: str, *extra: str) -> list[Child]:
        port = free_port()
        self.n_logs += 1
        argv = [
            *self.command,
            "--workdir",
            str(workdir),
            *extra,
            "--distributed",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
        ]
        return [
            Child(
                [*argv, "--process-id", str(i)],
                self.root / "logs" / f"{self.n_logs:02d}-{label}-p{i}.log",
                self.env,
                self.timeout,
            )
            for i in range(2)
        ]

    def problem(self, what: str, child: Child | None = None) -> None:
        tail = ""
        if child is not None:
            lines = [line for line in child.text().splitlines() if line.strip()]
            tail = f" (log {child.log}; last line: {lines[-1][:200] if lines else '<empty>'})"
        self.problems.append(f"{what}{tail}")

    def finished(self, procs: list[Child], what: str) -> bool:
        """Both processes end with 0, no `lm: lost` line and no crash output."""
        ok = True
        for i, child in enumerate(procs):
            code, text = child.finish(), child.text()
            wrong = ["hung (killed at --timeout)"] * child.hung + [f"exit {code}"] * (code != 0 and not child.hung)
            wrong += ["an `lm: lost` line"] * ("lm: lost" in text) + self.crash(text)
            if wrong:
                self.problem(f"{what}, process {i}: " + "; ".join(wrong), child)
                ok = False
        return ok

    @staticmethod
    def crash(text: str) -> list[str]:
        if "Traceback (most recent call last)" in text:
            return [f"a traceback ({traceback_line(text)})"]
        m = CRASH.search(text)
        return [f"crash output: {text[m.start() :].splitlines()[0][:120]!r}"] if m else []

    # ---- the cases ----

    def run_reference(self) -> bool:
        return self.finished(self.launch(self.reference, "reference"), "the uninterrupted run")

    def kill_mid_run(self, lost: int, target: int, resume_from: int | None = None) -> int | None:
        """Runs (resumed from the step given, or fresh) until step `target` is logged after a
        checkpoint, SIGKILLs process `lost`, checks the survivor; returns the step its line advises
        resuming from."""
        resume = resume_from is not None
        procs = self.launch(self.workdir, f"kill-p{lost}", *(["--resume"] * resume))
        case = f"process {lost}{' (coordinator)' if lost == 0 else ''} killed mid-run"
        survivor, victim = procs[1 - lost], procs[lost]

        def ready() -> bool:
            restored = survivor.restored() if resume else -1
            return (
                restored is not None
                and logged_step(self.workdir) >= max(target, restored + 1)
                and any(s <= logged_step(self.workdir) for s in saved_steps(self.workdir))
            )

        if not survivor.wait_until(ready) or victim.proc.poll() is not None:
            for child in procs:
                child.send(signal.SIGKILL)
                child.finish()
            self.problem(f"{case}: the run ended or hung before the kill point", survivor)
            self.rows.append([case, "-", "-", "-", "-", "-", "-"])
            return None
        if resume and survivor.restored() != resume_from:
            self.problem(
                f"{case}: resumed from step {survivor.restored()}, the last line named {resume_from}", survivor
            )
        victim.send(signal.SIGKILL)
        killed = time.monotonic()
        case = f"process {lost}{' (coordinator)' if lost == 0 else ''} killed at step {logged_step(self.workdir)}"
        code = survivor.finish()
        seconds = time.monotonic() - killed
        victim.finish()
        text = survivor.text()
        lines = [line for line in text.splitlines() if line.strip()]
        found = LOST.match(lines[-1]) if lines else None
        named = (
            found is not None
            and text.count("lm: lost") == 1
            and int(found.group(1)) == lost
            and int(found.group(3)) == 1 - lost
            and int(found.group(2)) >= PEER_S
        )
        saved = int(found.group(5)) if found and found.group(5) else None
        if named and saved is not None and not (self.workdir / "checkpoints" / str(saved)).is_dir():
            named = False
            self.problem(f"{case}: the line names checkpoint step {saved}, which is not there", survivor)
        crash, bound = self.crash(text), PEER_S + SLACK_S
        if not named:
            self.problem(f"{case}: no single `lm: lost process {lost} of 2` last line naming a checkpoint", survivor)
        if code != 75 or survivor.hung:
            self.problem(
                f"{case}: the survivor {'hung' if survivor.hung else f'exited {code}'} (expected 75)", survivor
            )
        if seconds > bound:
            self.problem(f"{case}: the survivor took {seconds:.1f} s to exit (bound {bound} s)", survivor)
        if crash:
            self.problem(f"{case}: {crash[0]}", survivor)
        self.rows.append(
            [
                case,
                f"yes ({saved})" if named else "NO",
                str(code),
                f"{seconds:.1f}",
                str(bound),
                "NO" if crash else "yes",
                "-",
            ]
        )
        return saved

    def startup_kills(self) -> None:
        """Two runs at once: in one process 0 is SIGKILLed right after its launch, in the other process 1."""
        runs = {
            lost: self.launch(
                self.root / f"startup-{lost}", f"startup-kill-p{lost}", "--startup-timeout", str(STARTUP_S)
            )
            for lost in (0, 1)
        }
        killed = time.monotonic()
        for lost, procs in runs.items():
            procs[lost].send(signal.SIGKILL)
        for lost, procs in runs.items():
            survivor = procs[1 - lost]
            case = f"process {lost}{' (coordinator)' if lost == 0 else ''} killed at start-up"
            code = survivor.finish()
            seconds = time.monotonic() - killed
            procs[lost].finish()
            text = survivor.text()
            lines = [line for line in text.splitlines() if line.strip()]
            found = STARTUP.match(lines[-1]) if lines else None
            named = (
                found is not None
                and int(next(g for g in found.groups() if g is not None)) == lost
                and sum(line.startswith("lm: ") for line in lines) == 1
            )
            crash, bound = self.crash(text), STARTUP_S + SLACK_S
            if not named:
                self.problem(f"{case}: no single start-up line naming process {lost} as the last line", survivor)
            if code == 0 or survivor.hung:
                self.problem(f"{case}: the survivor {'hung' if survivor.hung else 'exited 0'}", survivor)
            if seconds > bound:
                self.problem(f"{case}: the survivor took {seconds:.1f} s to exit (bound {bound} s)", survivor)
            if crash:
                self.problem(f"{case}: {crash[0]}", survivor)
            self.rows.append(
                [case, "yes" if named else "NO", str(code), f"{seconds:.1f}", str(bound), "NO" if crash else "yes", "-"]
            )

    def compare(self, procs: list[Child], resumed_from: int | None) -> str:
        """The final run resumed where the last line said, and everything equals the reference."""
        said = procs[0].restored()
        if resumed_from is not None and said != resumed_from:
            self.problem(f"the final run resumed from step {said}, the line named {resumed_from}", procs[0])
        ref, run = values_by_step(metric_rows(self.reference)), values_by_step(metric_rows(self.workdir))
        diffs = [
            f"step {s} {k}: {run.get(s, {}).get(k)!r} != {v!r}"
            for s in sorted(ref)
            for k, v in ref[s].items()
            if run.get(s, {}).get(k, object()) != v
        ]
        diffs += [f"step {s}: only in the drilled run" for s in sorted(set(run) - set(ref))]
        if diffs or len([s for s in ref if "loss" in ref[s]]) != STEPS:
            self.problem(
                f"logged values differ from the uninterrupted run: {diffs[0] if diffs else 'steps missing'}"
                f" ({len(diffs)} differ)"
            )
        try:
            diff = same_bits(final_params(self.reference, STEPS), final_params(self.workdir, STEPS))
        except Exception as e:  # noqa: BLE001 - reported as the drill's finding
            diff = f"cannot read the final params ({type(e).__name__}: {e})"
        if diff is not None:
            self.problem(f"final params differ from the uninterrupted run: {diff}")
        return "yes" if not diffs and diff is None else "NO"

    def run(self) -> dict:
        t0 = time.monotonic()
        if self.run_reference():
            first = self.kill_mid_run(1, KILL_AT[0])
            second = self.kill_mid_run(0, KILL_AT[1], resume_from=first) if first is not None else None
            if second is not None:
                procs = self.launch(self.workdir, "finish", "--resume")
                if self.finished(procs, "the final resumed run"):
                    exact = self.compare(procs, second)
                    self.rows.append(
                        [
                            f"both resumed from step {second} to the end",
                            "-",
                            str(procs[0].proc.returncode),
                            "-",
                            "-",
                            "yes",
                            exact,
                        ]
                    )
        self.startup_kills()
        return dict(rows=self.rows, problems=self.problems, notes=self.notes, seconds=time.monotonic() - t0)
