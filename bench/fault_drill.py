"""Fault drill: kill `lm train` again and again, damage checkpoints, resume, compare.

Runs the tiny model (shrunk for fast steps) once without interruption, then once more while
killing it at random steps (SIGKILL, SIGKILL during an async checkpoint save, SIGTERM),
damaging the newest checkpoint twice along the way, and resuming after every kill. Prints
how many kills were survived, how many resumes were bitwise exact (every loss logged after
the resume equals the uninterrupted run's, and the final params are identical), how many
steps had to be recomputed, and whether the damaged checkpoints were rejected.

    python bench/fault_drill.py [--kills 20] [--steps 240] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--config.data.curate=false", "--config.data.tokenizer=byte", "--config.model.vocab_size=264",
         "--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.n_heads=2",
         "--config.model.n_kv_heads=1", "--config.model.d_ff=64", "--config.data.seq_len=32",
         "--config.train.batch_size=8", "--config.eval.batches=1", "--config.eval.batch_size=8",
         "--config.train.sample_tokens=8", "--config.optim.warmup_steps=10", "--config.train.peak_flops=1e11",
         "--config.train.log_every=1", "--config.eval.every_steps=0", "--config.checkpoint.every_steps=10",
         "--config.checkpoint.keep=3", "--no-progress"]


def corpus_dir(tmp: pathlib.Path) -> pathlib.Path:
    """A dozen standard-library modules: enough text for a few hundred small steps."""
    import sysconfig

    out = tmp / "corpus"
    out.mkdir()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for name in ["abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "heapq.py", "keyword.py",
                 "numbers.py", "operator.py", "queue.py", "shlex.py", "textwrap.py"]:
        shutil.copy(stdlib / name, out / name)
    return out


class Run:
    """One `lm train` process in a workdir."""

    def __init__(self, workdir: pathlib.Path, corpus: pathlib.Path, steps: int, resume: bool):
        cmd = [sys.executable, "-m", "lm.cli", "train", "--config", "configs/tiny.py", "--workdir", str(workdir),
               f"--config.data.corpus={corpus}", f"--config.train.steps={steps}", *SMALL]
        env = os.environ | {"JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        self.workdir = workdir
        self.proc = subprocess.Popen(cmd + (["--resume"] if resume else []), cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_until(self, condition, timeout: float = 600.0) -> bool:
        """Polls until condition() holds (True) or the process ends (False)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def finish(self, timeout: float = 900.0) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out


def metric_rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def losses(workdir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metric_rows(workdir) if "loss" in r}


def logged_step(workdir: pathlib.Path) -> int:
    return max(losses(workdir), default=0)


def saving(workdir: pathlib.Path) -> bool:
    ckpt = workdir / "checkpoints"
    return ckpt.is_dir() and any("tmp" in name for name in os.listdir(ckpt))


def saved_steps(workdir: pathlib.Path) -> list[int]:
    ckpt = workdir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


def damage_newest(workdir: pathlib.Path, how: str) -> int:
    """Garbles or deletes the largest array file of the newest checkpoint; returns its step."""
    step = saved_steps(workdir)[-1]
    files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()
             and "ocdbt.process" in str(p)]
    target = max(files, key=lambda p: p.stat().st_size)
    if how == "delete":
        target.unlink()
    else:
        raw = bytearray(target.read_bytes())
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0xA5
        target.write_bytes(bytes(raw))
    return step


def final_params(workdir: pathlib.Path, step: int):
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager((workdir / "checkpoints").absolute(), item_names=("state",))
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


def kill_once(workdir, corpus, steps, target: int, kind: str, report: dict) -> None:
    """Starts (or resumes) the run, kills it at `target` in the way `kind` says, records what happened."""
    resume = bool(saved_steps(workdir))
    before = saved_steps(workdir)[-1] if resume else 0
    target = max(target, logged_step(workdir) + 1)  # rows left by the previous run do not count
    run = Run(workdir, corpus, steps, resume)
    if kind == "sigkill_during_save":
        reached = run.wait_until(lambda: logged_step(workdir) >= target and saving(workdir))
    else:
        reached = run.wait_until(lambda: logged_step(workdir) >= target)
    if not reached:  # finished or failed before the kill point
        code, out = run.finish()
        report["log"].append(out)
        raise SystemExit(f"run ended before the kill point {target} (exit {code}):\n{out[-3000:]}")
    run.proc.send_signal(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
    code, out = run.finish()
    resumed_from = int(m.group(1)) if (m := re.search(r"resumed from step (\d+)", out)) else before
    report["rejected"] += [int(s) for s in re.findall(r"checkpoint step (\d+) is damaged", out)]
    report["resumes"].append(resumed_from)
    reached_step = logged_step(workdir)
    report["events"].append(dict(kind=kind, target=target, reached=reached_step, resumed_from=resumed_from,
                                 exit=code))
    if kind == "sigterm":
        report["clean_stops"] += int(code == 0 and "--resume" in out)
    report["segments"].append((resume, resumed_from, dict(losses(workdir))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the work directories")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lm_fault_drill_"))
    corpus = corpus_dir(tmp)
    t0 = time.perf_counter()
    ref = Run(tmp / "reference", corpus, args.steps, resume=False)
    code, out = ref.finish()
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{out[-3000:]}")
    workdir = tmp / "drill"
    targets = sorted(rng.sample(range(3, args.steps - 30), args.kills))
    kinds = [rng.choice(["sigkill", "sigkill_during_save", "sigterm"]) for _ in targets]
    damage_at = {args.kills // 3: "garble", (2 * args.kills) // 3: "delete"}
    pending = []  # damage waits until an older checkpoint exists to fall back to
    report = dict(events=[], resumes=[], rejected=[], damaged=[], clean_stops=0, segments=[], log=[])
    for i, (target, kind) in enumerate(tqdm(list(zip(targets, kinds)), desc="kills", unit="kill")):
        pending += [damage_at[i]] if i in damage_at else []
        if pending and len(saved_steps(workdir)) >= 2:
            report["damaged"].append(damage_newest(workdir, pending.pop(0)))
        kill_once(workdir, corpus, args.steps, target, kind, report)
    if pending and len(saved_steps(workdir)) >= 2:
        report["damaged"].append(damage_newest(workdir, pending.pop(0)))
    last = Run(workdir, corpus, args.steps, resume=True)
    code, out = last.finish()
    report["rejected"] += [int(s) for s in re.findall(r"checkpoint step (\d+) is damaged", out)]
    resumed_from = int(m.group(1)) if (m := re.search(r"resumed from step (\d+)", out)) else 0
    report["segments"].append((True, resumed_from, losses(workdir)))
    _summarise(report, tmp, args, code, time.perf_counter() - t0)
    if not args.keep:
        shutil.rmtree(tmp)
    return 0


def _summarise(report: dict, tmp: pathlib.Path, args, final_code: int, seconds: float) -> None:
    import jax

    ref_losses = losses(tmp / "reference")
    a, b = final_params(tmp / "reference", args.steps), final_params(tmp / "drill", args.steps)
    params_equal = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                       zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    exact = 0
    resumed = [(start, seen) for was_resume, start, seen in report["segments"] if was_resume]
    for start, seen in resumed:
        after = {s: v for s, v in seen.items() if s > start}
        exact += int(all(ref_losses.get(s) == v for s, v in after.items()) and params_equal)
    n_resumes = len(resumed)
    next_start = report["resumes"][1:] + [report["segments"][-1][1]]
    lost = sum(max(e["reached"] - nxt, 0) for e, nxt in zip(report["events"], next_start))
    sigterms = sum(e["kind"] == "sigterm" for e in report["events"])
    during_save = sum(e["kind"] == "sigkill_during_save" for e in report["events"])
    rejected_ok = len(set(report["damaged"]) & set(report["rejected"]))
    false_rejects = len(set(report["rejected"]) - set(report["damaged"]))
    print(f"\nfault drill: {args.steps} steps, {args.kills} kills "
          f"({args.kills - sigterms - during_save} SIGKILL, {during_save} SIGKILL during a save, {sigterms} SIGTERM)")
    print(f"  kills survived:                  {len(report['events'])}/{args.kills} "
          f"(final run exit {final_code})")
    print(f"  SIGTERM clean exits (0 + hint):  {report['clean_stops']}/{sigterms}")
    print(f"  resumes bitwise exact:           {exact}/{n_resumes} (final params identical: {params_equal})")
    print(f"  steps lost (recomputed):         {lost} in all, {lost / max(args.kills, 1):.1f} per kill")
    print(f"  damaged checkpoints rejected:    {rejected_ok}/{len(report['damaged'])} "
          f"(steps {report['damaged']}); good ones rejected: {false_rejects}")
    print(f"  wall time:                       {seconds:.0f} s")
    print("  kills (kind@reached->resumed from): " + ", ".join(f"{e['kind']}@{e['reached']}->{r}"
                                                              for e, r in zip(report["events"], next_start)))


if __name__ == "__main__":
    sys.exit(main())
