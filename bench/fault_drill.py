"""Fault drill over every training stage: kill, stop, damage, resume, and compare bitwise.

For each stage (pretrain, sft, sft-lora, dpo, dpo-precomputed, reward, grpo, ppo, distill) on tiny
shapes: one uninterrupted run, then the same run again while it is
  - SIGKILLed at random steps, during a checkpoint save, and at a random moment after its start;
  - sent SIGTERM at start-up (a fresh run and a resumed one), mid-run, and after its last
    checkpoint (end-of-run work): each must exit 0 with a message whose command finishes the run;
  - resumed after damage of each kind: a state array file truncated, the data-iterator JSON one
    position further, the meta JSON changed, a token id of the prepared-data cache entry changed,
    the cache entry truncated: each must be rejected (checkpoint) or rebuilt (cache entry);
  - joined by a second writer on its workdir (while the first is paused): it must be refused;
  - resumed, between two episodes, by another stage's command, by its own command with other
    trajectory settings, and (on a copy) as another run: each must be refused in one line with
    nothing in the workdir changed; a precomputed DPO reference replaced by one computed from
    other pairs must be computed again with one warning (bench/fault_drill_identity.py);
and every logged value after each resume (timings aside) and the final params must equal the
uninterrupted run's bitwise; at the end summary.json must be there and TensorBoard's points must
equal metrics.jsonl's rows. With pretrain among the stages, its run is also drilled as a
two-process run losing a process mid-run and at start-up (bench/fault_drill_lost_host.py; table of
its own; --no-lost-host skips it, --only-lost-host runs it alone). Every child writes to a log
file under the drill's directory and has a deadline (--timeout).

    python bench/fault_drill.py [--stages sft,dpo] [--kills 6] [--seed 0] [--timeout 300] [--keep]
                                [--no-lost-host | --only-lost-host]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the drill itself reads checkpoints at the end

from fault_drill_identity import COLUMNS as IDENTITY_COLUMNS  # noqa: E402
from fault_drill_identity import IdentityCases, cells
from fault_drill_lost_host import COLUMNS as LOST_HOST_COLUMNS  # noqa: E402
from fault_drill_lost_host import PEER_S, STARTUP_S, LostHostDrill
from fault_drill_parts import (  # noqa: E402 - bench/ is on the path when run as a script
    CHECKPOINT_DAMAGE,
    Child,
    child_env,
    damage_cache,
    damage_checkpoint,
    final_params,
    lock_holder,
    logged_step,
    metric_rows,
    same_bits,
    saved_steps,
    saving,
    stamp,
    summary_step,
    table,
    tensorboard_matches,
    traceback_line,
    values_by_step,
)
from fault_drill_stages import EVERY, STAGES, STEPS, UNCACHED, Episode, Inputs, plan, setup, stage_command  # noqa: E402

STOPPED = re.compile(r"^lm: (.*?)(?:run again with the same command|Continue with|finish it with): lm (.*)$", re.M)
PHASE = re.compile(r"^lm: stopped by SIGTERM (?:during (.*?)|at step (\d+));", re.M)


class StageDrill:
    """One stage: its uninterrupted run, then the drilled run, and the verdict."""

    def __init__(self, name: str, inp: Inputs, root: pathlib.Path, args, rng: random.Random):
        self.name, self.root, self.args, self.rng = name, root, args, rng
        self.command = stage_command(name, inp)
        self.workdir, self.reference, self.cache = root / "drill", root / "reference", root / "cache"
        (root / "logs").mkdir(parents=True)
        self.env = child_env(self.cache)
        self.n_logs = 0
        self.ref_values: dict = {}
        self.ref_seconds = 0.0
        self.next_argv: list[str] | None = None  # the command a stop message gave
        self.pending: list[str] = []  # damage kinds not applied yet (a checkpoint needs an older one to fall back to)
        self.applied: list[dict] = []  # damage applied, waiting for a verdict
        self.r = dict(
            kills=0,
            kills_survived=0,
            resumes=0,
            resumes_exact=0,
            sigterms=0,
            sigterms_ok=0,
            damages=0,
            rejected=0,
            wrongly_rejected=0,
            silent_wrong=0,
            writer="-",
            summary="-",
            tensorboard="-",
            problems=[],
            notes=[],
            events=[],
            kill_pending=False,
        )
        self.identity = IdentityCases(self, inp)

    # ---- children ----

    def argv(self, resume: bool) -> list[str]:
        return [*self.command, "--workdir", str(self.workdir), *(["--resume"] if resume else [])]

    def start(self, argv: list[str], label: str) -> Child:
        self.n_logs += 1
        return Child(argv, self.root / "logs" / f"{self.n_logs:02d}-{label}.log", self.env, self.args.timeout)

    def problem(self, what: str, child: Child | None = None) -> None:
        tail = ""
        if child is not None:
            lines = [line for line in child.text().splitlines() if line.strip()]
            tail = f" (log {child.log}; last line: {lines[-1][:200] if lines else '<empty>'})"
        self.r["problems"].append(f"{what}{tail}")

    # ---- the uninterrupted run ----

    def run_reference(self) -> bool:
        t0 = time.monotonic()
        child = self.start([*self.command, "--workdir", str(self.reference)], "reference")
        code = child.finish()
        self.ref_seconds = time.monotonic() - t0
        if code != 0 or child.hung:
            self.problem(f"the uninterrupted run {'hung' if child.hung else f'exited {code}'}", child)
            return False
        self.ref_values = values_by_step(metric_rows(self.reference))
        return True

    # ---- the drilled run ----

    def episode(self, ep: Episode) -> None:
        resume = bool(saved_steps(self.workdir))
        argv, self.next_argv = self.next_argv or self.argv(resume), None
        self.apply_damage(ep.damage)
        ep.before = stamp(self.workdir / "final_metrics.json")
        child = self.start(argv, ep.end)
        t0 = time.monotonic()
        reached = self.wait_for_fault(child, ep, t0)
        if reached:
            at = f"{time.monotonic() - t0:.1f} s"
            child.send(signal.SIGKILL if ep.end.startswith("sigkill") else signal.SIGTERM)
        code = child.finish()
        self.judge(child, ep, code, reached)
        if reached and ep.end.startswith("sigkill"):
            restored = child.restored() is not None or "--resume" not in argv
            where = f"step {logged_step(self.workdir)}" if restored else "before the restore"
            self.r["events"].append(f"{ep.end[8:]} kill ({at}, {where})")
        elif reached and (m := PHASE.search(child.text())):
            self.r["events"].append(f"SIGTERM {ep.end[8:]} ({m.group(1) or 'at step ' + m.group(2)})")

    def wait_for_fault(self, child: Child, ep: Episode, t0: float) -> bool:
        w, end = self.workdir, ep.end
        if ep.writer and child.wait_until(lambda: bool(saved_steps(w))):
            self.second_writer(child)

        def after_restore(condition):  # rows a previous child left past the restored step do not count
            fresh = "--resume" not in child.argv
            return lambda: (r := -1 if fresh else child.restored()) is not None and condition(r)

        def target(restored: int) -> int:
            return min(max(ep.target, restored + 1), STEPS - 1)

        if end == "sigterm_start":  # a fresh run as soon as it holds the lock; a resume a moment later
            if not child.wait_until(lambda: lock_holder(w) == child.pid, poll=0.001):
                return False
            at = time.monotonic() + (self.rng.uniform(0, 1) if "--resume" in child.argv else 0)
            return child.wait_until(lambda: time.monotonic() >= at, poll=0.005)
        if end in ("sigkill_step", "sigterm_mid"):
            return child.wait_until(after_restore(lambda r: logged_step(w) >= target(r)))
        if end == "sigkill_save":
            return child.wait_until(after_restore(lambda r: logged_step(w) >= target(r) and saving(w)), poll=0.001)
        if end == "sigkill_time":  # a random moment (start-up included), before the run's last steps
            at = t0 + self.rng.uniform(0.05, 0.9) * self.ref_seconds
            late = after_restore(lambda r: logged_step(w) >= max(STEPS - EVERY - 1, r + 1))
            return child.wait_until(lambda: time.monotonic() >= at or late(), poll=0.005)
        if end == "sigterm_end":  # the loop's final metrics written by this child (the end-of-run work
            final = w / "final_metrics.json"  # starts), summary.json not yet; then a random moment of that work
            if not child.wait_until(lambda: stamp(final) not in (None, ep.before), poll=0.005):
                return False
            at = time.monotonic() + self.rng.uniform(0, 0.5)
            return child.wait_until(lambda: time.monotonic() >= at, poll=0.005) and not (w / "summary.json").exists()
        return False  # finish: no fault

    def second_writer(self, holder: Child) -> None:
        """Pauses the holder (it keeps its lock), starts a second run on the workdir, resumes the holder."""
        holder.send(signal.SIGSTOP)
        try:
            other = self.start(self.argv(resume=True), "second-writer")
            code = other.finish()
        finally:
            holder.send(signal.SIGCONT)
        errors = [line for line in other.text().splitlines() if line.startswith("lm: error:")]
        named = len(errors) == 1 and "in use by another run" in errors[0] and f"pid {holder.pid}" in errors[0]
        self.r["writer"] = "yes" if code == 2 and named else "NO"
        if self.r["writer"] != "yes":
            self.problem(f"second writer: exit {code}, expected 2 and one line naming pid {holder.pid}", other)

    def apply_damage(self, kinds: list[str]) -> None:
        self.pending += kinds
        for kind in list(self.pending):
            if kind in CHECKPOINT_DAMAGE:
                if len(saved_steps(self.workdir)) < 2 or any(
                    d.get("step") == saved_steps(self.workdir)[-1] for d in self.applied
                ):
                    continue  # wait for a checkpoint to fall back to (and damage each step once)
                done = damage_checkpoint(self.workdir, kind)
            else:
                if any("entry" in d for d in self.applied):
                    continue  # one damaged entry at a time
                done = damage_cache(self.cache, kind)
                if done is None:
                    continue
            self.pending.remove(kind)
            self.applied.append(done)
            self.r["damages"] += 1

    def judge(self, child: Child, ep: Episode, code: int, reached: bool) -> None:
        text = child.text()
        label = f"{ep.end} child"
        killed = "SIGKILL" in child.signals
        expected = (-signal.SIGKILL,) if killed else (0,)
        failed = child.hung or code not in expected
        if child.hung:
            self.problem(f"{label} hung (no exit within --timeout {self.args.timeout:.0f} s; killed)", child)
        elif code not in expected and not ep.end.startswith("sigterm"):  # judge_stop says it
            self.problem(f"{label} exited {code} (expected {expected[0]})", child)
        if self.r["kill_pending"] and not failed:
            self.r["kills_survived"] += 1
        self.r["kill_pending"] = False
        if killed:
            self.r["kills"] += 1
            self.r["kill_pending"] = True
        if ep.end.startswith("sigterm"):
            self.judge_stop(child, ep, code, reached, text)
        elif not reached and ep.end != "finish" and not failed:
            self.r["notes"].append(f"{ep.end}: the child ended before the kill point (log {child.log})")
        if "Traceback (most recent call last)" in text and not failed and not ep.end.startswith("sigterm"):
            self.problem(f"{label}: a traceback in its output ({traceback_line(text)})", child)
        self.judge_rejections(child, text)
        self.compare(child, text)
        self.identity.seen(child)

    def judge_stop(self, child: Child, ep: Episode, code: int, reached: bool, text: str) -> None:
        if not reached:
            self.r["notes"].append(f"{ep.end}: the child ended before the stop point (log {child.log})")
            return
        self.r["sigterms"] += 1
        m = STOPPED.search(text)
        summary = (self.workdir / "summary.json").exists()
        if m:
            self.next_argv = shlex.split(m.group(2))
            expected = self.argv(resume=bool(saved_steps(self.workdir)))
            if self.next_argv != expected:
                self.problem(f"{ep.end}: the stop message's command differs from the run's: {m.group(2)}", child)
        wrong = [f"exit {code}"] * (code != 0) + ["no stop message"] * (not m)
        wrong += ["summary.json written anyway"] * (ep.end == "sigterm_end" and summary)
        if "Traceback (most recent call last)" in text:
            wrong.append(f"a traceback in its output ({traceback_line(text)})")
        if wrong:
            self.problem(f"{ep.end}: " + "; ".join(wrong), child)
        self.r["sigterms_ok"] += int(not wrong)

    def judge_rejections(self, child: Child, text: str) -> None:
        for step in map(int, re.findall(r"checkpoint step (\d+) is damaged", text)):
            self.verdict(child, lambda d: d.get("step") == step, f"checkpoint step {step}")
        for entry in re.findall(r"data cache entry '([^']+)' is bad", text):
            self.verdict(child, lambda d: d.get("entry") == pathlib.Path(entry).name, f"cache entry {entry}")
        restored = (
            "resumed from step" in text
            or (self.workdir / "summary.json").exists()
            or "during the end-of-run evaluation" in text
        )
        if restored:
            for d in self.applied:  # read and not rejected: used
                self.problem(
                    f"damage '{d['kind']}' of {d.get('step', d.get('entry'))} ({d['file']}) was not rejected", child
                )
            self.applied = []

    def verdict(self, child: Child, match, what: str) -> None:
        found = next((d for d in self.applied if match(d)), None)
        if found is None:
            self.r["wrongly_rejected"] += 1
            self.problem(f"{what} rejected but it was not damaged", child)
        else:
            self.r["rejected"] += 1
            self.applied.remove(found)

    def compare(self, child: Child, text: str) -> None:
        """Every value this child logged equals the uninterrupted run's."""
        restored, fresh = child.restored(), "--resume" not in child.argv
        if restored is None and not fresh:
            return  # stopped before its restore, or nothing left to train
        start = -1 if restored is None else restored
        now = values_by_step(metric_rows(self.workdir))
        steps = [s for s in now if s > start]
        if not steps:
            return
        diffs = [
            f"step {s} {k}: {v!r} != {self.ref_values.get(s, {}).get(k)!r}"
            for s in sorted(steps)
            for k, v in now[s].items()
            if self.ref_values.get(s, {}).get(k, object()) != v
        ]
        if restored is not None:
            self.r["resumes"] += 1
            self.r["resumes_exact"] += int(not diffs)
        if diffs:
            loud = "lm: warning" in text
            self.r["silent_wrong"] += int(not loud)
            self.problem(
                f"{'silent ' if not loud else ''}wrong values after "
                f"{f'resuming from step {start}' if restored is not None else 'a fresh start'}: {diffs[0]} "
                f"({len(diffs)} differ)",
                child,
            )

    def finish_checks(self) -> None:
        for _ in range(2):  # a run the plan left unfinished (a missed fault point) is finished here
            if summary_step(self.workdir) == STEPS:
                break
            child = self.start(self.argv(resume=bool(saved_steps(self.workdir))), "finish-again")
            self.judge(child, Episode("finish"), child.finish(), False)
            self.r["notes"].append(f"summary.json was missing after the plan; one more --resume (log {child.log})")
        self.identity.finish()
        self.r["summary"] = "yes" if summary_step(self.workdir) == STEPS else "NO"
        if self.r["summary"] != "yes":
            self.problem(f"summary.json missing or not of step {STEPS} at the end")
        try:
            diff = same_bits(final_params(self.reference, STEPS), final_params(self.workdir, STEPS))
        except Exception as e:  # noqa: BLE001 - reported as the drill's finding
            diff = f"cannot read the final params ({type(e).__name__}: {e})"
        if diff is not None:
            self.r["silent_wrong"] += 1
            self.problem(f"final params differ from the uninterrupted run: {diff}")
        bad = [(w.name, tensorboard_matches(w)) for w in (self.reference, self.workdir)]
        bad = [(n, d) for n, d in bad if d is not None]
        self.r["tensorboard"] = "yes" if not bad else "NO"
        for n, d in bad:
            self.problem(f"TensorBoard of the {n} run: {d}")

    def run(self, kills: int) -> dict:
        t0 = time.monotonic()
        if self.run_reference():
            episodes = plan(self.rng, kills, cached=self.name not in UNCACHED)
            for i, ep in enumerate(episodes):
                if summary_step(self.workdir) == STEPS:  # a missed fault point let the run finish early
                    self.r["notes"].append(
                        f"the run finished before the plan's end; its last {len(episodes) - i} episode(s) were skipped"
                    )
                    break
                self.episode(ep)
                if i < len(episodes) - 1:
                    self.identity.between()
            self.finish_checks()
        self.r["seconds"] = time.monotonic() - t0
        return self.r


COLUMNS = [
    ("stage", 16),
    ("kills survived", 9),
    ("resumes exact", 9),
    ("SIGTERM clean", 9),
    ("damages rejected", 9),
    ("good wrongly rejected", 9),
    ("silent wrong", 7),
    ("2nd writer refused", 9),
    ("summary present", 8),
    ("TB == metrics", 8),
    *IDENTITY_COLUMNS,
    ("wall s", 7),
]


def rows(results: dict) -> list[list[str]]:
    return [
        [
            name,
            f"{r['kills_survived']}/{r['kills']}",
            f"{r['resumes_exact']}/{r['resumes']}",
            f"{r['sigterms_ok']}/{r['sigterms']}",
            f"{r['rejected']}/{r['damages']}",
            str(r["wrongly_rejected"]),
            str(r["silent_wrong"]),
            r["writer"],
            r["summary"],
            r["tensorboard"],
            *cells(r),
            f"{r['seconds']:.0f}",
        ]
        for name, r in results.items()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--kills", type=int, default=6, help="SIGKILLs per stage (besides the 4 SIGTERMs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each child may take")
    ap.add_argument("--keep", action="store_true", help="keep the work directories (kept anyway on a problem)")
    ap.add_argument(
        "--lost-host",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with pretrain among the stages, drill it as a two-process run losing a process",
    )
    ap.add_argument("--only-lost-host", action="store_true", help="the lost-host case alone (no stage drills)")
    args = ap.parse_args()
    if args.only_lost_host:
        args.stages, args.lost_host = "pretrain", True
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    most = STEPS - 3 * EVERY - 2  # distinct kill steps between the second checkpoint and the last steps
    if unknown or not 1 <= args.kills <= most:
        ap.error(
            f"unknown stage(s) {unknown}; choose from {','.join(STAGES)}"
            if unknown
            else f"--kills must be between 1 and {most}"
        )
    t0 = time.monotonic()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lm_fault_drill_"))
    what = (
        "the lost-host case alone"
        if args.only_lost_host
        else f"{len(stages)} stage(s), {args.kills} SIGKILLs + 4 SIGTERMs + damage per stage"
    )
    print(f"fault drill in {tmp}: {what}, {STEPS} steps each, seed {args.seed}", flush=True)
    inp = setup(tmp, stages, args.timeout)
    results = {}
    for name in stages * (not args.only_lost_host):
        rng = random.Random(f"{args.seed}-{name}")
        results[name] = StageDrill(name, inp, tmp / name, args, rng).run(args.kills)
        r = results[name]
        print(f"  {name}: {r['seconds']:.0f} s, {len(r['problems'])} problem(s)", flush=True)
    if results:
        print()
        print("\n".join(table(COLUMNS, rows(results))))
        print("\nwhat was done (kill: where it landed; SIGTERM: the phase its message names):")
        print("\n".join(f"  {n}: " + ", ".join(r["events"]) for n, r in results.items()))
    if args.lost_host and "pretrain" in stages:
        print(
            f"\nlost host: pretrain as 2 processes x 4 CPU devices, --peer-timeout {PEER_S}, --startup-timeout "
            f"{STARTUP_S}",
            flush=True,
        )
        lost = LostHostDrill(inp, tmp / "lost-host", args.timeout).run()
        print("\n".join(table(LOST_HOST_COLUMNS, lost["rows"])) + f"\n  ({lost['seconds']:.0f} s)")
        results["lost-host"] = lost
    problems = [(n, p) for n, r in results.items() for p in r["problems"]]
    notes = [(n, p) for n, r in results.items() for p in r["notes"]]
    for title, items in (("problems", problems), ("notes", notes)):
        if items:
            print(f"\n{title}:")
            print("\n".join(f"  {n}: {p}" for n, p in items))
    print(f"\nwall time: {time.monotonic() - t0:.0f} s (logs: {tmp if problems or args.keep else 'removed'})")
    if not problems and not args.keep:
        shutil.rmtree(tmp)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
