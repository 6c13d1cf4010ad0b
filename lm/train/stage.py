"""The one stage runner: every training stage (pretraining, SFT, DPO, reward, RL, distillation) is
a declaration over `run_stage` — its data, its run (loss, trained params, frozen models), its
batches and evaluators, what it reports. The runner does the rest, in this order:

    cheap checks -> the workdir claimed: writable, locked -> resume checks: a checkpoint there
    (or none, for a fresh run), made by this stage and this run (all before any data work) ->
    the init model -> the data (noted by content) -> settings derived from the data (epochs ->
    steps: a new config) -> the run's identity (lm.train.identity) -> nothing left to do? ->
    the run -> batch checks -> a resume's checkpoint fits the run and is this trajectory's (its
    metadata) -> state and frozen models (the frozen ones from their sources on
    every start, a resume included) -> batches, evaluators (+ config.eval.sets) -> the one loop
    (lm.train.fit; the run files are written there, once the state is restored or made) ->
    stop reason -> the stage's report, the plot, summary.json

Nothing in the workdir changes until every check has passed, and only one run writes there at a
time. summary.json is written last: a run whose training ended but whose end-of-run work was
cut short (a kill during the final evaluation, sample or plot) has none, and --resume restores
its final checkpoint and does that work. SIGTERM/SIGINT stop a run cleanly in every phase
(lm.train.faults.StopSignal): inside the loop with a checkpoint, elsewhere at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import uuid
from typing import Callable

import jax
import numpy as np

from lm.config import Config, freeze, with_values
from lm.data.provenance import recording
from lm.errors import UserError
from lm.eval.during import with_sets
from lm.model.params import merge_trees
from lm.store.load import Loaded, load_init
from lm.store.meta import save_tokenizer, with_tokenizer
from lm.train.faults import StopSignal, agree_any
from lm.train.fit import check_fits, check_made_by, check_resume, fit, newest_meta, save_final_metrics
from lm.train.identity import RUN_FILE, new_identity, read_run_file
from lm.train.metrics import json_default, plot_curves, read_metrics
from lm.train.registry import stage_entry
from lm.train.workdir import check_writable, lock_workdir, write_atomic

ALL_STEPS = 2**62  # "any step": a resume check that needs no step count yet


@dataclasses.dataclass
class Ctx:
    """What a run has come to so far; each phase of the runner fills in more."""

    config: Config
    workdir: pathlib.Path
    resume: bool
    show_progress: bool = True
    init: Loaded | None = None  # the model the stage starts from (None: a fresh one)
    data: object = None  # whatever the stage's `read` returns
    data_notes: dict = dataclasses.field(default_factory=dict)  # the content of what it read (lm.data.provenance)
    identity: dict | None = None  # what the run is (lm.train.identity): in every checkpoint
    run: object = None  # lm.train.setup.Run
    frozen: dict | None = None  # {name: placed params} (lm.train.steps)
    state: object = None
    last: dict = dataclasses.field(default_factory=dict)  # the loop's final metrics
    params: dict | None = None  # the trained model's full params at the end (frozen base merged in)
    returned: dict = dataclasses.field(default_factory=dict)  # returned beside the summary, not written
    stop: StopSignal | None = None  # signals, handled in every phase

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    @property
    def checkpoints(self) -> pathlib.Path:
        return self.workdir / "checkpoints"

    def phase(self, name: str, **kw) -> None:
        """The run enters phase `name` (what a stop by signal names; lm.train.faults.StopSignal.enter)."""
        self.stop.enter(name, **kw)


class Stage:
    """A training stage as a declaration: override what differs."""

    name: str = ""  # its entry in lm.train.registry
    init_section: str | None = None  # the config section whose `init` names the start model
    init_optional: bool = False  # an empty `init` starts from scratch instead of failing (pretraining)
    check_eval_batch = True  # eval.batch_size must split over the mesh like train.batch_size

    @property
    def verb(self) -> str:
        """The command that runs it (`lm VERB`, from its registry entry), recorded as the run's stage."""
        return stage_entry(self.name).command

    def check(self, config) -> None:
        """Checks that need no data (before any data work)."""

    def read(self, ctx: Ctx):
        raise NotImplementedError

    def configure(self, ctx: Ctx) -> Config:
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
    config = freeze(config)  # the stage reads the frozen config (a built ConfigDict is frozen here)
    ctx = Ctx(config, pathlib.Path(workdir), resume, show_progress)
    with StopSignal() as ctx.stop:  # the command's own when lm.cli installed one at start-up
        ctx.phase("the checks")
        stage.check(config)
        with _claimed(ctx):
            check_resume(ctx.checkpoints, resume, ALL_STEPS)
            if resume:
                check_made_by(ctx.checkpoints, _identity(stage, ctx, early=True))
            _prepare(stage, ctx)
            ctx.identity = _identity(stage, ctx)
            finished = check_resume(ctx.checkpoints, resume, ctx.config.train.steps)
            if finished is not None and _summarized(ctx.workdir, finished):
                return {"step": finished, "nothing_to_do": True, "stopped_by": None, "eval_loss": None}
            if finished is not None:
                print(
                    f"lm: training ended at step {finished} but its end-of-run work did not (no summary.json): "
                    "restoring the final checkpoint to do it",
                    flush=True,
                )
            _build(stage, ctx)
            _train(stage, ctx)
            if ctx.last["stopped_by"]:
                return {"step": ctx.last["stop_step"], "stopped_by": ctx.last["stopped_by"], "eval_loss": None}
            return _finish(stage, ctx)


@contextlib.contextmanager
def _claimed(ctx: Ctx):
    """The workdir for this run alone, and writable wherever the run writes: before any data work.
    The processes of one run share it: process 0 holds the lock, and all refuse together."""
    with contextlib.ExitStack() as held:
        problem = None
        try:
            check_writable(ctx.workdir)
            if ctx.is_main:
                held.enter_context(lock_workdir(ctx.workdir))
        except UserError as e:
            problem = e
        if agree_any([problem is not None])[0]:
            raise problem or UserError(f"another process of this run refused --workdir {ctx.workdir} (see its error)")
        yield


def _prepare(stage: Stage, ctx: Ctx) -> None:
    """The init model, the data, and the settings that follow from the data (a new config). A
    stage that trains with its init model's tokenizer records it in data.tokenizer (the run keeps
    its files: `_write_run_files`)."""
    if stage.init_section and (ctx.config[stage.init_section].init or not stage.init_optional):
        ctx.phase("loading the init model")
        ctx.init = load_init(ctx.config[stage.init_section].init)
    ctx.phase("data preparation")
    with recording() as ctx.data_notes:
        ctx.data = stage.read(ctx)
    ctx.config = stage.configure(ctx)
    if ctx.init is not None and stage.tokenizer(ctx) is ctx.init.tokenizer:
        ctx.config = with_tokenizer(ctx.config, ctx.init.tokenizer)


def _build(stage: Stage, ctx: Ctx) -> None:
    """The run and its batch checks; a resume's checkpoint must fit it (read from its metadata,
    before anything is written)."""
    ctx.phase("building the run")
    ctx.run = run = stage.build(ctx)
    t, e = ctx.config.train, ctx.config.eval
    run.check_batch(t.batch_size, t.micro_batches)
    if stage.check_eval_batch:
        run.check_batch(e.batch_size, 1, key="eval.batch_size")
    if ctx.resume:
        check_fits(run, ctx.checkpoints)
        check_made_by(ctx.checkpoints, ctx.identity, ("settings", "data", "models"), run.updates_per_step)


def _train(stage: Stage, ctx: Ctx) -> None:
    """State and frozen models, batches and evaluators, the one loop; the run files are written once
    the state is restored (or made)."""
    run, base = ctx.run, (ctx.init.params if ctx.init is not None else None)
    ctx.phase("placing the models")
    # A fresh run builds its state; frozen params (a LoRA base, a reference, a teacher) come from
    # their sources on every start, a resume included.
    if run.trainable is not None or not ctx.resume:
        state0, ctx.frozen = run.init(base=base, sources=stage.sources(ctx))
    else:
        state0, ctx.frozen = None, run.frozen_params(base, stage.sources(ctx))
    ctx.phase("preparing the batches and evaluators")  # a DPO reference pass included
    data_iter, signature, step_fn = stage.batches(ctx)
    evaluate = with_sets(stage.evaluator(ctx), ctx.config.eval, run.built, stage.tokenizer(ctx), ctx.frozen)
    ctx.phase("training", defer=True, saved=True)
    ctx.state, ctx.last = fit(
        run,
        ctx.workdir,
        data_iter,
        resume=ctx.resume,
        init=lambda: state0,
        ready=lambda: _write_run_files(stage, ctx),
        evaluate=evaluate,
        first_row=stage.first_row(ctx),
        frozen=ctx.frozen,
        signature=signature,
        show_progress=ctx.show_progress,
        flops_per_token=stage.flops_per_token(ctx),
        step_fn=step_fn,
        identity=ctx.identity,
    )
    if ctx.is_main and not ctx.last["stopped_by"]:
        save_final_metrics(ctx.workdir, ctx.last)


def _finish(stage: Stage, ctx: Ctx) -> dict:
    """The stage's report, the plot, then summary.json: written last and whole, it marks the run done."""
    ctx.phase("the end-of-run evaluation", saved=True)
    ctx.params = merge_trees(ctx.state.params, (ctx.frozen or {}).get("base"))
    summary = stage.finish(ctx)
    if ctx.is_main:
        stage.plot(ctx)
    # A safe point: a signal whose StopRequested was swallowed where it landed (Python drops
    # exceptions raised inside a gc callback, e.g. jax's) still stops the run before it is marked done.
    ctx.phase("writing the summary", saved=True)
    if ctx.is_main:
        write_atomic(ctx.workdir / "summary.json", json.dumps(summary, indent=2, default=json_default))
    return summary | ctx.returned


def _summarized(workdir: pathlib.Path, step: int) -> bool:
    """Whether the run's summary.json is there and reports `step` (one from a shorter run does not count)."""
    try:
        return json.loads((workdir / "summary.json").read_text()).get("step") == step
    except (OSError, ValueError, AttributeError):
        return False


def _identity(stage: Stage, ctx: Ctx, early: bool = False) -> dict:
    """This run's identity: a fresh run draws a new id; a resume keeps the one of run.json, or of
    the newest checkpoint (a run whose run.json is gone). Early (before the data are read) only
    its stage and id are known."""
    first = {}
    if ctx.resume:
        first = read_run_file(ctx.workdir) or newest_meta(ctx.checkpoints)[1].get("identity") or {}
    if early:
        return {"stage": stage.verb, "run_id": first.get("run_id")}
    return new_identity(stage.verb, ctx.config, ctx.data_notes, first or {"run_id": _shared_run_id()})


def _shared_run_id() -> str:
    """A new run id, process 0's on every process (each checks checkpoints against it)."""
    run_id = uuid.uuid4().hex[:12]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        drawn = np.frombuffer(run_id.encode(), np.uint8)
        run_id = bytes(np.asarray(multihost_utils.broadcast_one_to_all(drawn)).astype(np.uint8)).decode()
    return run_id


def _write_run_files(stage: Stage, ctx: Ctx) -> None:
    """config.json, data_stats.json, run.json (the identity the run started with) and the tokenizer
    (WORKDIR/tokenizer.model or WORKDIR/tokenizer/: lm.store.meta.save_tokenizer), by process 0,
    once every check has passed."""
    if not ctx.is_main:
        return
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    if (read_run_file(ctx.workdir) or {}).get("run_id") != ctx.identity["run_id"]:
        write_atomic(ctx.workdir / RUN_FILE, json.dumps(ctx.identity, indent=2, default=str))
    write_atomic(ctx.workdir / "config.json", ctx.config.to_json(indent=2))
    write_atomic(ctx.workdir / "data_stats.json", json.dumps(stage.stats(ctx), indent=2))
    save_tokenizer(stage.tokenizer(ctx), ctx.workdir)


def with_steps(config, steps: int) -> Config:
    """A copy of `config` training for `steps` steps (the validated config is never changed)."""
    return with_values(config, {"train.steps": steps})


def trainable_count(run) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(run.abstract_state().params))


def first_eval(workdir) -> dict:
    """The held-out metrics logged at step 0 (the init model's), or {}."""
    rows = [r for r in read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if r.get("step") == 0]
    return {k: v for r in rows for k, v in r.items() if k.startswith("eval_")}


def require_data(path: str, key: str, hint: str) -> None:
    if not path:
        raise UserError(f"{key} is empty; {hint}")
