"""The one stage runner: every training stage (pretraining, SFT, DPO, reward, RL, distillation) is
a declaration over `run_stage` — its data, its run (loss, trained params, frozen models), its
batches and evaluators, what it reports. The runner does the rest, in this order:

    cheap checks -> resume checks (before any data work) -> the init model -> the data ->
    settings derived from the data (epochs -> steps: a new config) -> nothing left to do? ->
    the run -> batch checks -> run files -> state and frozen models (the frozen ones from their
    sources on every start, a resume included) -> batches, evaluators (+ config.eval.sets) ->
    the one loop (lm.train.fit) -> stop reason -> the stage's report, the plot, summary.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Callable

import jax

from lm.config import ConfigDict
from lm.errors import UserError
from lm.eval.during import with_sets
from lm.model.params import merge_trees
from lm.store.load import Loaded, load_init
from lm.store.meta import save_tokenizer
from lm.train.fit import check_resume, fit
from lm.train.metrics import json_default, plot_curves, read_metrics

ALL_STEPS = 2**62  # "any step": a resume check that needs no step count yet


@dataclasses.dataclass
class Ctx:
    """What a run has come to so far; each phase of the runner fills in more."""

    config: ConfigDict
    workdir: pathlib.Path
    resume: bool
    show_progress: bool = True
    init: Loaded | None = None  # the model the stage starts from (None: a fresh one)
    data: object = None  # whatever the stage's `read` returns
    run: object = None  # lm.train.setup.Run
    frozen: dict | None = None  # {name: placed params} (lm.train.steps)
    state: object = None
    last: dict = dataclasses.field(default_factory=dict)  # the loop's final metrics
    params: dict | None = None  # the trained model's full params at the end (frozen base merged in)
    returned: dict = dataclasses.field(default_factory=dict)  # returned beside the summary, not written

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0


class Stage:
    """A training stage as a declaration: override what differs."""

    init_section: str | None = None  # the config section whose `init` names the start model
    check_eval_batch = True  # eval.batch_size must split over the mesh like train.batch_size

    def check(self, config) -> None:
        """Checks that need no data (before any data work)."""

    def read(self, ctx: Ctx):
        raise NotImplementedError

    def configure(self, ctx: Ctx) -> ConfigDict:
        """Settings that follow from the data (e.g. train.steps from epochs): a new config."""
        return ctx.config

    def build(self, ctx: Ctx):
        raise NotImplementedError

    def sources(self, ctx: Ctx) -> dict | None:
        """Host params of frozen models that do not come from the init model ({name: params})."""
        return None

    def stats(self, ctx: Ctx) -> dict:
        raise NotImplementedError

    def tokenizer(self, ctx: Ctx):
        return ctx.init.tokenizer

    def batches(self, ctx: Ctx) -> tuple:
        """(training data iterator, batch signature, step function or None for the jitted update)."""
        raise NotImplementedError

    def evaluator(self, ctx: Ctx) -> Callable | None:
        return None

    def first_row(self, ctx: Ctx) -> dict:
        return {}

    def flops_per_token(self, ctx: Ctx) -> float | None:
        return None

    def finish(self, ctx: Ctx) -> dict:
        """The summary (written to summary.json); printing the stage's tables is its own."""
        return {}

    def plot(self, ctx: Ctx) -> None:
        plot_curves(ctx.workdir / "metrics.jsonl", ctx.workdir / "loss.png")


def run_stage(stage: Stage, config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    ctx = Ctx(config, pathlib.Path(workdir), resume, show_progress)
    stage.check(config)
    checkpoints = ctx.workdir / "checkpoints"
    check_resume(checkpoints, resume, ALL_STEPS)
    if stage.init_section:
        ctx.init = load_init(config[stage.init_section].init)
    ctx.data = stage.read(ctx)
    ctx.config = stage.configure(ctx)
    finished = check_resume(checkpoints, resume, ctx.config.train.steps)
    if finished is not None:
        return {"step": finished, "nothing_to_do": True, "stopped_by": None, "eval_loss": None}
    ctx.run = run = stage.build(ctx)
    t, e = ctx.config.train, ctx.config.eval
    run.check_batch(t.batch_size, t.micro_batches)
    if stage.check_eval_batch:
        run.check_batch(e.batch_size, 1, key="eval.batch_size")
    _write_run_files(stage, ctx)
    base = ctx.init.params if ctx.init is not None else None
    # A fresh run builds its state; frozen params (a LoRA base, a reference, a teacher) come from
    # their sources on every start, a resume included.
    if run.trainable is not None or not resume:
        state0, ctx.frozen = run.init(base=base, sources=stage.sources(ctx))
    else:
        state0, ctx.frozen = None, run.frozen_params(base, stage.sources(ctx))
    data_iter, signature, step_fn = stage.batches(ctx)
    evaluate = with_sets(stage.evaluator(ctx), e, run.built, stage.tokenizer(ctx), ctx.frozen)
    ctx.state, ctx.last = fit(run, ctx.workdir, data_iter, resume=resume, init=lambda: state0, evaluate=evaluate,
                              first_row=stage.first_row(ctx), frozen=ctx.frozen, signature=signature,
                              show_progress=show_progress, flops_per_token=stage.flops_per_token(ctx),
                              step_fn=step_fn)
    if ctx.last["stopped_by"]:
        return {"step": ctx.last["stop_step"], "stopped_by": ctx.last["stopped_by"], "eval_loss": None}
    ctx.params = merge_trees(ctx.state.params, (ctx.frozen or {}).get("base"))
    summary = stage.finish(ctx)
    if ctx.is_main:
        stage.plot(ctx)
        (ctx.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
    return summary | ctx.returned


def _write_run_files(stage: Stage, ctx: Ctx) -> None:
    """config.json, data_stats.json and the tokenizer, by process 0, once every check has passed."""
    if not ctx.is_main:
        return
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    (ctx.workdir / "config.json").write_text(ctx.config.to_json(indent=2))
    (ctx.workdir / "data_stats.json").write_text(json.dumps(stage.stats(ctx), indent=2))
    save_tokenizer(stage.tokenizer(ctx), ctx.workdir)


def with_steps(config, steps: int) -> ConfigDict:
    """A copy of `config` training for `steps` steps (the validated config is never changed)."""
    out = ConfigDict(config.to_dict())
    out.train.steps = steps
    return out


def trainable_count(run) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract_state().params))


def first_eval(workdir) -> dict:
    """The held-out metrics logged at step 0 (the init model's), or {}."""
    rows = [r for r in read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if r.get("step") == 0]
    return {k: v for r in rows for k, v in r.items() if k.startswith("eval_")}


def require_data(path: str, key: str, hint: str) -> None:
    if not path:
        raise UserError(f"{key} is empty; {hint}")
