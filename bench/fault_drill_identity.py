"""The fault drill's identity cases (bench/fault_drill.py), run on the drilled workdir once it holds
a checkpoint and the run is not finished:

  - wrong stage: another stage's command with --resume (pretrain: `lm sft`; SFT, LoRA, reward: `lm
    dpo`; the others: `lm sft`) must be refused in one line naming both stages;
  - foreign settings: the stage's own command with other trajectory settings of the same shapes
    (optim.lr, train.seed) must be refused in one line naming both keys;
  - another run: the stage's own command on a copy of the workdir whose run.json names another run
    (checkpoints of another run) must be refused in one line naming the runs;
each with exit 2, no traceback, and every file of the workdir (its lock aside) byte for byte as
before. With a precomputed DPO reference, the reference file is then replaced by one computed
from other pairs (same arrays and shapes, other values, a record whose data fingerprint differs):
the next resume that reads it must compute it again with one warning, get the values it had
(bitwise), and log what the uninterrupted run logged (the drill's own comparison).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil

import numpy as np
from fault_drill_parts import Child, saved_steps, summary_step, traceback_line
from fault_drill_stages import STEPS, Inputs, stage_command

# The stage whose command resumes another's workdir in the wrong-stage case.
OTHER = {
    "pretrain": "sft",
    "sft": "dpo",
    "sft-lora": "dpo",
    "reward": "dpo",
    "dpo": "sft",
    "dpo-precomputed": "sft",
    "grpo": "sft",
    "ppo": "sft",
    "distill": "sft",
}
FOREIGN = ["--config.optim.lr=2e-4", "--config.train.seed=7"]  # other values, the same shapes
REF_FILE, RECORD = "reference_logps.npz", "record"  # lm.train.dpo's file and the array holding its record
STALE_WARNING = "lm: warning: the precomputed reference '"


def tree(workdir: pathlib.Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes ('dir' for a directory)} of everything but the lock."""
    out = {}
    for path in sorted(workdir.rglob("*")):
        rel = str(path.relative_to(workdir))
        if rel == ".lock":
            continue
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def tree_change(before: dict, after: dict) -> str | None:
    """The first path added, removed or changed between two `tree`s, as a phrase (None if none)."""
    for rel in sorted(before.keys() | after.keys()):
        if before.get(rel) != after.get(rel):
            how = "added" if rel not in before else "removed" if rel not in after else "changed"
            return f"{rel} {how}"
    return None


class IdentityCases:
    """The identity cases of one stage's drill (`drill`: its StageDrill, for children and problems)."""

    def __init__(self, drill, inp: Inputs):
        self.drill, self.inp = drill, inp
        self.done = False
        self.stale: dict | None = None  # the planted file: {"digest", "train"} until a child replaces it
        r = drill.r
        r.update(
            wrong_stage=0,
            wrong_stage_n=0,
            foreign=0,
            foreign_n=0,
            stale_ok=0,
            stale_n=0 if drill.name == "dpo-precomputed" else None,
        )

    # ---- refusals ----

    def between(self) -> None:
        """After an episode: the cases, once, where a checkpoint exists, no damage waits for its
        verdict, and the run is not finished."""
        d = self.drill
        if self.done or not saved_steps(d.workdir) or d.applied or summary_step(d.workdir) == STEPS:
            return
        self.done = True
        stale = " (then the reference made stale)" * (d.r["stale_n"] is not None)
        d.r["events"].append(f"identity cases at checkpoint {saved_steps(d.workdir)[-1]}{stale}")
        self.refusals()
        if d.r["stale_n"] is not None:
            self.plant_stale()

    def refusals(self) -> None:
        d, workdir = self.drill, self.drill.workdir
        before = tree(workdir)
        other = OTHER[d.name]
        inp = self.inp if self.inp.base is not None else dataclasses.replace(self.inp, base=d.reference)
        theirs, ours = d.command[0], stage_command(other, inp)[0]
        copy = d.root / "another-run"
        shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns(".lock"))
        run_file = copy / "run.json"
        identity = json.loads(run_file.read_text())
        identity["run_id"] = "0" * 12
        run_file.write_text(json.dumps(identity, indent=2))
        copy_before = tree(copy)
        # the wrong stage on the workdir and another run on its copy side by side, then the settings
        wrong = d.start([*stage_command(other, inp), "--workdir", str(workdir), "--resume"], f"wrong-stage-{other}")
        another = d.start([*d.command, "--workdir", str(copy), "--resume"], "another-run")
        d.r["wrong_stage_n"] += 1
        d.r["wrong_stage"] += self.refused(wrong, [f"stage: {theirs} (checkpoint) vs {ours} (now)"], workdir, before)
        d.r["foreign_n"] += 2
        ok = self.refused(another, ["run: ", f"vs {identity['run_id']} (this workdir)"], copy, copy_before)
        d.r["foreign"] += ok
        if ok:
            shutil.rmtree(copy)
        foreign = d.start([*d.command, *FOREIGN, "--workdir", str(workdir), "--resume"], "foreign-settings")
        d.r["foreign"] += self.refused(foreign, ["optim.lr: ", "train.seed: "], workdir, before)

    def refused(self, child: Child, expect: list[str], workdir: pathlib.Path, before: dict) -> bool:
        """Exit 2, one `lm: error:` line saying the checkpoint is not this run's with every phrase
        of `expect`, no traceback, the workdir unchanged."""
        code, text = child.finish(), child.text()
        errors = [line for line in text.splitlines() if line.startswith("lm: error:")]
        wrong = ["hung"] * child.hung + [f"exit {code} (expected 2)"] * (code != 2 and not child.hung)
        if len(errors) != 1:
            wrong.append(f"{len(errors)} 'lm: error:' lines (expected 1)")
        else:
            missing = [e for e in ["is not this run's to resume", *expect] if e not in errors[0]]
            wrong += [f"the error line lacks {missing}"] * bool(missing)
        if "Traceback (most recent call last)" in text:
            wrong.append(f"a traceback in its output ({traceback_line(text)})")
        if (change := tree_change(before, tree(workdir))) is not None:
            wrong.append(f"the workdir changed ({change})")
        if wrong:
            self.drill.problem(f"{child.log.stem}: " + "; ".join(wrong), child)
        return not wrong

    # ---- the stale precomputed reference ----

    def plant_stale(self) -> None:
        """Replaces the reference file by one computed from other pairs: the same arrays and shapes,
        other (finite) values, the record with another data fingerprint."""
        path = self.drill.workdir / REF_FILE
        if not path.is_file():
            self.drill.problem(f"no {REF_FILE} in the drilled workdir to make stale")
            return
        with np.load(path, allow_pickle=False) as saved:
            arrays = {k: saved[k] for k in saved.files}
        record = json.loads(str(arrays[RECORD][()]))
        record["data"]["train"] = hashlib.sha256(b"other pairs").hexdigest()
        rng = np.random.default_rng(7)
        stale = {k: (-rng.uniform(1, 100, a.shape)).astype(a.dtype) for k, a in arrays.items() if k != RECORD}
        tmp = path.with_name(REF_FILE + ".stale")
        with open(tmp, "wb") as f:
            np.savez(f, **stale, **{RECORD: np.array(json.dumps(record))})
        os.replace(tmp, path)
        self.stale = {"digest": hashlib.sha256(path.read_bytes()).hexdigest(), "train": arrays["train"]}
        self.drill.r["stale_n"] += 1

    def seen(self, child: Child) -> None:
        """After each child of the drilled run: did it read the stale reference, and what did it do?"""
        if self.stale is None:
            return
        path = self.drill.workdir / REF_FILE
        lines = [line for line in child.text().splitlines() if line.startswith(STALE_WARNING)]
        bad = [line for line in lines if not (line.endswith("computing it again") and "other data" in line)]
        if bad:
            self.drill.problem(f"stale reference: the warning does not name other data: {bad[0][:200]}", child)
        try:
            replaced = hashlib.sha256(path.read_bytes()).hexdigest() != self.stale["digest"]
        except OSError:
            replaced = False
        if not replaced:
            if child.restored() is not None:
                self.drill.problem("stale reference: a resume trained without computing the reference again", child)
                self.stale = None
            return  # stopped before it read the reference: the next child reads it
        wrong = [f"{len(lines)} warning lines (expected 1)"] * (len(lines) != 1)
        with np.load(path, allow_pickle=False) as saved:
            again = saved["train"]
        if again.shape != self.stale["train"].shape or again.tobytes() != self.stale["train"].tobytes():
            wrong.append("the values computed again differ from the first computation's")
        if wrong:
            self.drill.problem("stale reference: " + "; ".join(wrong), child)
        self.drill.r["stale_ok"] += int(not wrong)
        self.stale = None

    def finish(self) -> None:
        if not self.done:
            self.drill.problem("the identity cases never ran (no unfinished checkpoint without damage pending)")
        if self.stale is not None:
            self.drill.problem("stale reference: no child read it again before the run finished")


def cells(r: dict) -> list[str]:
    """The identity cases' table cells of one stage."""
    return [
        f"{r['wrong_stage']}/{r['wrong_stage_n']}",
        f"{r['foreign']}/{r['foreign_n']}",
        "-" if r["stale_n"] is None else f"{r['stale_ok']}/{r['stale_n']}",
    ]


COLUMNS = [("wrong stage refused", 7), ("foreign ckpt refused", 8), ("stale ref recomputed", 10)]
