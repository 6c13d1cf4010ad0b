"""What a run is, recorded in every checkpoint and checked by --resume.

A run's identity: its stage (the verb that made it), an id drawn at its first start and kept by
every resume, the command that started it, and what shapes its trajectory:
  settings  every config key except those that leave the trajectory alone (NEUTRAL: logging,
            evaluation, checkpoint cadence, the mesh, implementation choices, the fault policy,
            and the paths of data and models, which are named by their content instead);
  data      the content of the data the stage read (lm.data.provenance: prepared cache entries
            by their manifests, files by their sha256);
  models    the models it starts from or holds frozen (init, teacher, reward model), by
            lm.store.fingerprint.
A checkpoint whose record differs is another stage's, another run's or another trajectory's:
--resume refuses it in one line, naming the fields and the command that made it. A checkpoint
written before these records existed is restored with one warning.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time
import types
import uuid

from lm.config.moved import MOVED
from lm.errors import UserError
from lm.store.fingerprint import fingerprint_or_empty

RUN_FILE = "run.json"  # the identity a run started with, beside its checkpoints

# Keys (or prefixes ending in '.') whose change keeps the trajectory: resume may change them.
NEUTRAL = (
    "eval.",
    "checkpoint.",
    "mesh.",
    "curate.workers",
    "data.cache_dir",
    "data.workers",
    "data.tokenizer",
    "data.corpus",
    "data.sources",
    "train.log_every",
    "train.peak_flops",
    "train.sample_tokens",
    "train.sample_prompt",
    "train.max_bad_steps",
    "train.on_bad",
    "train.spike_window",
    "train.spike_threshold",
    "train.max_rollbacks",
    "model.remat",
    "model.kernels",
    "model.attention",
    "model.pipeline_microbatches",
    "finetune.data",
    "finetune.on_bad_record",
    "finetune.max_skipped_fraction",
)
MODEL_KEYS = ("train.init", "finetune.init", "distill.teacher", "rl.reward_model")


def _neutral(key: str) -> bool:
    name = key.partition(".")[2]
    return (
        key in NEUTRAL
        or any(p.endswith(".") and key.startswith(p) for p in NEUTRAL)
        or key in MODEL_KEYS
        or name.startswith("eval_")
    )


def flat_keys(d: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested dict."""
    out = {}
    for k, v in d.items():
        out |= flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def settings(config) -> dict:
    """{dotted key: value} of the config keys that shape the trajectory."""
    flat = flat_keys(json.loads(config.to_json()))
    weights = [entry.rsplit(":", 1)[1] if ":" in entry else "1" for entry in flat.get("data.sources") or []]
    return {k: v for k, v in flat.items() if not _neutral(k) and k not in SCHEDULE} | (
        {"data.source_weights": weights} if weights else {}
    )


# The run's length shapes the steps already taken only through the learning rate (lm.train.optim):
# a resume may change it when the schedule gives the same rate to every update made so far (a
# longer run with optim.decay_steps set, or one still in its warmup).
SCHEDULE = ("train.steps", "optim.decay_steps")


def schedule(config) -> dict:
    return {"train.steps": config.train.steps, "optim.decay_steps": config.optim.decay_steps}


def _same_rates(saved: dict, now: dict, updates: int) -> bool:
    import numpy as np

    from lm.train.optim import make_schedule

    def rates(part: dict):
        s = now["settings"]
        o = types.SimpleNamespace(
            lr=s["optim.lr"],
            warmup_steps=s["optim.warmup_steps"],
            min_lr_ratio=s["optim.min_lr_ratio"],
            decay_steps=part["optim.decay_steps"],
            schedule=s.get("optim.schedule", "cosine"),
            decay_fraction=s.get("optim.decay_fraction", 0.2),
            decay_shape=s.get("optim.decay_shape", "linear"),
        )
        return np.asarray(make_schedule(o, part["train.steps"])(np.arange(updates)))

    return np.array_equal(rates(saved["schedule"]), rates(now["schedule"]))


def models(config) -> dict:
    """{config key: fingerprint} of every model the run starts from or holds frozen."""
    out = {}
    for key in MODEL_KEYS:
        section, name = key.split(".")
        value = config[section].get(name) if section in config else None
        if value:
            out[key] = fingerprint_or_empty(value)
    return out


_COMMAND: list[str] = []  # the arguments of `lm` when it was called with some (lm.cli.main)


def record_command(argv: list[str]) -> None:
    _COMMAND[:] = argv


def new_identity(stage: str, config, data: dict, first: dict | None = None) -> dict:
    """This run's identity; a resume keeps the id, command and start time of its `first` start
    (run.json, or the newest checkpoint's identity)."""
    first = first or {}
    argv = _COMMAND or sys.argv[1:]
    return {
        "stage": stage,
        "run_id": first.get("run_id") or uuid.uuid4().hex[:12],
        "command": first.get("command") or shlex.join(["lm", *argv])[:2000],
        "started": first.get("started") or time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": settings(config),
        "schedule": schedule(config),
        "data": data,
        "models": models(config),
    }


PARTS = ("settings", "data", "models")


def differences(saved: dict, now: dict, parts: tuple = PARTS, updates: int | None = None) -> list[str]:
    """What differs between a checkpoint's identity and this run's, one phrase per field (the
    stage and the run id, then `parts`; the schedule with `updates`, the updates made so far)."""
    diffs = []
    if saved.get("stage") != now["stage"]:
        diffs.append(f"stage: {saved.get('stage')} (checkpoint) vs {now['stage']} (now)")
    if now.get("run_id") and saved.get("run_id") != now["run_id"]:
        diffs.append(f"run: {saved.get('run_id')} (checkpoint) vs {now['run_id']} (this workdir)")
    for part in parts:
        before, after = _before_moves(part, saved.get(part) or {}), now.get(part) or {}
        for key in sorted(before.keys() | after.keys()):
            if part == "settings" and key not in before:
                continue  # a key added to the code since the checkpoint: its default is all it knew
            if before.get(key) != after.get(key):
                label = f"{key}" if part == "settings" else f"{part} {key}"
                diffs.append(
                    f"{label}: {before.get(key, '(none)')!r} (checkpoint) vs {after.get(key, '(none)')!r} (now)"
                )
    if (
        updates is not None
        and not diffs
        and saved.get("schedule")
        and saved["schedule"] != now["schedule"]
        and not _same_rates(saved, now, updates)
    ):
        shown = ", ".join(
            f"{k}={saved['schedule'][k]} (checkpoint) vs {now['schedule'][k]} (now)"
            for k in SCHEDULE
            if saved["schedule"][k] != now["schedule"][k]
        )
        diffs.append(f"the learning rate of the {updates} updates made differs ({shown})")
    return diffs


def _before_moves(part: str, recorded: dict) -> dict:
    """A checkpoint's record in today's keys (lm.config.moved): model paths renamed; moved settings
    dropped, as several sections held each (a key new to a checkpoint is not compared)."""
    if part == "settings":
        return {k: v for k, v in recorded.items() if k not in MOVED}
    return {MOVED.get(k, k): v for k, v in recorded.items()}


class NotThisRun(UserError):
    """A checkpoint made by another stage, another run or another trajectory: never restored, never moved."""


def check_identity(
    saved: dict | None, now: dict | None, where: str, parts: tuple = PARTS, updates: int | None = None
) -> None:
    """Refuses a checkpoint whose identity differs from `now`; a checkpoint without one passes
    (the caller warns once)."""
    if not saved or not now:
        return
    diffs = differences(saved, now, parts, updates)
    if not diffs:
        return
    shown = "; ".join(diffs[:8]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 8 else "")
    raise NotThisRun(
        f"{where} is not this run's to resume ({shown}); it was made by `{saved.get('command')}`: "
        f"resume it with `{resume_command(saved.get('command') or 'lm')}`, or start this one in a new "
        "--workdir"
    )


def resume_command(command: str) -> str:
    """A run's first command as the command that resumes it."""
    words = shlex.split(command)
    return shlex.join(words if "--resume" in words else [*words, "--resume"])


def read_run_file(workdir) -> dict | None:
    """The identity recorded in WORKDIR/run.json (None if missing or unreadable)."""
    try:
        value = json.loads((pathlib.Path(workdir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
