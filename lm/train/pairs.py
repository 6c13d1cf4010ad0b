"""What `lm dpo` and `lm reward` share: preference pairs in, a run over [B, 2, T] batches
(lm.train.pair_losses), the one loop (lm.train.fit), and the held-out pair metrics before and after.

A stage prepares its `PairStage` (the init model, the train and held-out pairs, the number of
steps), builds its run with its loss, then calls `train`; what it reports at the end is its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import numpy as np

from lm.data.cache import data_cache_dir
from lm.data.pipeline import Source, ready_batches, train_dataset
from lm.data.preference import describe, prepare_pairs
from lm.data.sft import SftSettings
from lm.errors import UserError
from lm.eval.during import with_sets
from lm.store.load import load_init
from lm.store.meta import save_tokenizer
from lm.train.fit import check_resume, evaluator, fit
from lm.train.metrics import read_metrics

# Every pair row carries its margin (the reward model's; DPO ignores it).
PAIR_EXTRA = {"margin": ((), np.float32)}


class WithFields:
    """Ready rows with per-row fields added: i -> rows[i] | {name: values[i]} (e.g. reference log-probs)."""

    def __init__(self, rows, fields: dict[str, np.ndarray]):
        self.rows, self.fields = rows, fields
        self.seq_len = rows.seq_len
        for name, values in fields.items():
            if len(values) != len(rows):
                raise ValueError(f"field '{name}' has {len(values)} rows for {len(rows)} pairs")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i] | {k: v[i] for k, v in self.fields.items()}


@dataclasses.dataclass
class PairStage:
    config: object
    workdir: pathlib.Path
    loaded: object  # lm.store.load.Loaded: the init model
    train: object  # lm.data.preference.PairExamples
    heldout: object | None


def settings(config) -> SftSettings:
    p = config.pairs
    return SftSettings(seq_len=config.data.seq_len, truncation=p.truncation, on_bad_record=p.on_bad_record,
                       max_skipped_fraction=p.max_skipped_fraction)


def steps_for_epochs(pairs: int, epochs: float, batch_size: int) -> int:
    return max(1, math.ceil(epochs * pairs / batch_size))


def prepare(config, workdir, resume: bool, verb: str) -> PairStage | dict:
    """The init model and the pairs, checked before any training; a dict when the run already
    finished (nothing to do)."""
    p, workdir = config.pairs, pathlib.Path(workdir)
    if not p.data:
        raise UserError(f"pairs.data is empty; give `lm {verb} --data pairs.jsonl` "
                        '({"prompt", "chosen", "rejected"} lines)')
    check_resume(workdir / "checkpoints", resume, total_steps=2**62)  # before any data work
    loaded = load_init(p.init)
    cache = data_cache_dir(config.data)
    train = prepare_pairs(p.data, loaded.tokenizer, settings(config), cache)
    print(f"{verb} data {p.data}: {describe(train.stats)}")
    heldout = prepare_pairs(p.eval_data, loaded.tokenizer, settings(config), cache) if p.eval_data else None
    if p.epochs > 0:
        config.train.steps = steps_for_epochs(len(train), p.epochs, config.train.batch_size)
    finished = check_resume(workdir / "checkpoints", resume, config.train.steps)
    if finished is not None:
        return {"step": finished, "nothing_to_do": True, "stopped_by": None}
    return PairStage(config, workdir, loaded, train, heldout)


def write_run_files(stage: PairStage) -> None:
    if jax.process_index() != 0:
        return
    stage.workdir.mkdir(parents=True, exist_ok=True)
    (stage.workdir / "config.json").write_text(stage.config.to_json(indent=2))
    stats = {"train": stage.train.stats} | ({"heldout": stage.heldout.stats} if stage.heldout else {})
    (stage.workdir / "data_stats.json").write_text(json.dumps(stats, indent=2))
    save_tokenizer(stage.loaded.tokenizer, stage.workdir)


def train(stage: PairStage, run, *, resume: bool, show_progress: bool, eval_metrics: tuple,
          extra: dict | None = None, fields: tuple = (None, None), flops_per_token: float | None = None):
    """Trains `run` on the stage's pairs from the init model. extra: {name: (shape, dtype)} of
    per-pair fields beyond the margin, whose values `fields` holds ({name: array} for the train
    and the held-out pairs). Returns (state, frozen, last) as lm.train.fit does."""
    config, t, e = stage.config, stage.config.train, stage.config.eval
    run.check_batch(t.batch_size, t.micro_batches)
    run.check_batch(e.batch_size, 1, key="eval.batch_size")
    write_run_files(stage)
    base = stage.loaded.params
    lora = run.trainable is not None
    # Frozen params (a LoRA base, a reference model) come from --init on every start, a resume
    # included; a full fine-tune's fresh state is only built when there is no checkpoint.
    state0, frozen = run.init(base=base) if (lora or not resume) else (None, run.frozen_params(base))
    extra = PAIR_EXTRA | (extra or {})
    signature = run.signature(pairs=True, extra=extra)
    placer = run.placer(signature)
    rows = WithFields(stage.train, fields[0]) if fields[0] else stage.train
    data_iter = iter(train_dataset([Source(config.pairs.data, rows, 1.0)], seq_len=config.data.seq_len,
                                   global_batch=t.batch_size, seed=t.seed, rows=placer.rows, pack=False))
    evaluate = None
    if stage.heldout is not None:
        held = WithFields(stage.heldout, fields[1]) if fields[1] else stage.heldout
        eval_signature = run.signature(e.batch_size, pairs=True, extra=extra)
        batches = ready_batches(held, e.batch_size, config.pairs.eval_pairs)
        evaluate = evaluator(run.eval_step(eval_signature), batches, run.placer(eval_signature), frozen,
                             metrics=eval_metrics)
    first_row = {"trainable_params": sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract_state().params)),
                 **{f"data/{k}": v for k, v in stage.train.stats.items()}}
    evaluate = with_sets(evaluate, e, run.built, stage.loaded.tokenizer, frozen)
    state, last = fit(run, stage.workdir, data_iter, resume=resume, init=lambda: state0, evaluate=evaluate,
                      first_row=first_row, frozen=frozen, signature=signature, show_progress=show_progress,
                      flops_per_token=flops_per_token)
    return state, frozen, last


def first_eval(workdir) -> dict:
    """The held-out metrics logged at step 0 (the init model's), or {}."""
    rows = [r for r in read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if r.get("step") == 0]
    return {k: v for r in rows for k, v in r.items() if k.startswith("eval_")}


def eval_table(title: str, keys: tuple, before: dict, after: dict, n: int | None) -> str:
    """Held-out metrics of the init and the tuned model, one line each."""
    head = f"{'model':<8}" + "".join(f" {k:>20}" for k in keys)
    lines = [f"{title} ({n} held-out pairs)" if n else title, head]
    for name, row in (("init", before), ("tuned", after)):
        cells = [row.get(f"eval_{k}") for k in keys]
        lines.append(f"{name:<8}" + "".join(f" {c:>20.4f}" if isinstance(c, float) else f" {'-':>20}" for c in cells))
    return "\n".join(lines)
