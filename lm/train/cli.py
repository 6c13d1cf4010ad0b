"""`lm train`, `lm sft`, `lm dpo`, `lm reward` (and `lm reward score`), `lm rl`, `lm distill`: a verb
for every stage of the stage registry (lm.train.registry). Stages are imported inside `run`, after
the CPU flags are set from the config."""

from __future__ import annotations

import importlib
import sys

from lm.errors import UserError
from lm.train.registry import StageEntry, load, stages
from lm.verb import Stopped, add_distributed, is_main, start_distributed, with_overrides


class Pretrain:
    """A stage that starts from a config file (`lm train`): a model from scratch, or --init."""

    def __init__(self, entry: StageEntry):
        self.entry = entry

    def add_parser(self, sub) -> None:
        t = with_overrides(sub, self.entry.command, help=self.entry.help, description=self.entry.description)
        t.add_argument("--config", default="configs/tiny.py", help="a Python config file with get_config()")
        t.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots")
        t.add_argument(
            "--init",
            help="continue pretraining a model: an `lm train` workdir, an `lm export` or a "
            "Hugging Face model directory (its architecture and tokenizer are used)",
        )
        t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
        t.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
        add_distributed(t)
        for flag, text, *_ in self.entry.options:
            t.add_argument(flag, help=text)

    def run(self, args, overrides) -> int:
        from lm.config import load_config

        config = load_config(args.config, [*_option_keys(self.entry, args), *overrides])
        if args.init:
            from pathlib import Path

            from lm.store.meta import init_config, tokenizer_source
            from lm.train.finetune import continued_config

            init = str(Path(args.init).absolute())
            start = init_config(init)
            config = continued_config(config, start, init, tokenizer_source(init, start), overrides)
        summary = _run_stage(self.entry, config, args)
        if summary.get("nothing_to_do"):
            print(
                f"lm: {args.workdir} already finished at step {summary['step']} (train.steps="
                f"{config.train.steps}); nothing left to do, no file was changed. To train further, "
                "raise --config.train.steps",
                file=sys.stderr,
            )
            return 0
        if summary["eval_loss"] is not None and is_main():
            print(
                f"done: step {summary['step']}, held-out loss {summary['eval_loss']:.4f} "
                f"(unigram baseline {summary['unigram_baseline']:.4f}); see {args.workdir}/{self.entry.plot}"
            )
        return 0


def _run_stage(entry: StageEntry, config, args) -> dict:
    """Runs the stage on `config` (CPU flags first, then the multi-host start); a stop by signal
    leaves as `Stopped`, which the CLI reports with the command to continue."""
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
    start_distributed(args)
    summary = load(entry.stage)(config, args.workdir, resume=args.resume, show_progress=not args.no_progress)
    if summary.get("stopped_by"):
        raise Stopped(summary["stopped_by"], summary["step"])
    return summary


def _option_keys(entry: StageEntry, args) -> list[str]:
    """The dotted keys a config-file stage's own flags set: the flag's key, else one of its section."""
    out = []
    for flag, _, *key in entry.options:
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest) is not None:
            out.append(f"{key[0] if key else f'{entry.section}.{dest}'}={getattr(args, dest)}")
    return out


class FineTune:
    """A stage that starts from a trained model (--init) and reads JSONL (--data)."""

    def __init__(self, entry: StageEntry):
        self.entry = entry

    def add_parser(self, sub) -> None:
        self.build(sub)

    def build(self, sub):
        """The verb's parser and its required arguments."""
        e = self.entry
        p = with_overrides(sub, e.command, help=e.help, description=e.description)
        required = [
            p.add_argument(
                "--init",
                required=True,
                help="an `lm train`/`lm sft` workdir, an `lm export` or a Hugging Face model directory to start from",
            ),
            p.add_argument("--data", required=True, help=e.data),
        ]
        p.add_argument("--eval-data", help=e.eval_data)
        required.append(p.add_argument("--workdir", required=True, help="directory for checkpoints, metrics, plots"))
        p.add_argument(
            "--config",
            help="a config file whose get_config() sets some keys (default: built-in "
            "fine-tuning defaults, lm/config/finetune.py)",
        )
        p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
        add_distributed(p)
        for flag, text, *_ in e.options:
            p.add_argument(flag, help=text)
        return p, required

    def run(self, args, overrides) -> int:
        from pathlib import Path

        from lm.config.finetune import DEFAULTS
        from lm.store.meta import init_config
        from lm.train.finetune import finetune_config

        if not Path(args.init).exists():
            raise UserError(
                f"--init {args.init}: no such file or directory; expected an `lm train`/`lm sft` "
                "workdir, an `lm export` or a Hugging Face model directory"
            )
        init = str(Path(args.init).absolute())  # the run records where its base lives
        keys, elsewhere = {"init": init, "data": args.data, "eval_data": args.eval_data}, []
        for flag, _, *key in self.entry.options:
            dest = flag[2:].replace("-", "_")
            value = getattr(args, dest)
            if value is not None and key:  # a key of another section, set before the user's overrides
                elsewhere.append(f"{key[0]}={str(Path(value).absolute()) if value and Path(value).exists() else value}")
            elif value and dest in DEFAULTS:
                keys[dest] = value
            elif value:
                elsewhere.append(f"{self.entry.section}.{dest}={value}")
        config = finetune_config(init_config(init), args.config, [*elsewhere, *overrides], self.entry.name, **keys)
        summary = _run_stage(self.entry, config, args)
        if summary.get("nothing_to_do"):
            print(f"lm: {args.workdir} already finished at step {summary['step']}; nothing left to do", file=sys.stderr)
            return 0
        if is_main():
            print(f"done: step {summary['step']}; see {args.workdir}/summary.json and {self.entry.plot}")
        return 0


class WithActions:
    """A fine-tuning verb with sub-actions (`lm reward` trains a reward model; `lm reward score`
    scores with one): each action module adds its parser to the verb's and runs its own."""

    def __init__(self, train: FineTune):
        self.train, self.parser, self.required = train, None, []
        self.actions = {}

    def add_parser(self, sub) -> None:
        p, required = self.train.build(sub)
        usage = p.format_usage().removeprefix("usage: ")  # the training form, as argparse writes it
        for action in required:  # argparse cannot require a flag only without a sub-action: run checks them
            action.required = False
        actions = p.add_subparsers(dest="action", prog=p.prog, title="sub-actions")
        for name in self.train.entry.actions:
            module, before = importlib.import_module(name), set(actions.choices)
            module.add_parser(actions)
            self.actions |= {added: module for added in set(actions.choices) - before}
        forms = (a.format_usage().removeprefix("usage: ") for a in actions.choices.values())
        p.usage = usage + "".join("       " + form for form in forms)
        self.parser, self.required = p, required

    def run(self, args, overrides) -> int:
        if args.action is not None:
            return self.actions[args.action].run(args, overrides)
        missing = [a.option_strings[0] for a in self.required if getattr(args, a.dest) is None]
        if missing:
            self.parser.error(f"the following arguments are required: {', '.join(missing)}")
        return self.train.run(args, overrides)


_VERBS: dict[StageEntry, object] = {}  # one verb object per entry, the same on every call


def verb(entry: StageEntry):
    """The verb that runs `entry`: its CLI form follows how the stage starts and its sub-actions."""
    if entry not in _VERBS:
        form = Pretrain(entry) if entry.start == "config" else FineTune(entry)
        _VERBS[entry] = WithActions(form) if entry.actions else form
    return _VERBS[entry]


def verbs() -> tuple:
    """A verb for every registered stage, in the registry's order."""
    return tuple(verb(e) for e in stages())


def __getattr__(name: str):
    """The verb of a stage by its name in capitals (`REWARD`), or its command's (`TRAIN`)."""
    for entry in stages():
        if name in (entry.name.upper(), entry.command.upper()):
            return verb(entry)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
