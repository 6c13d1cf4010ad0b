"""`lm` command line: a table of verbs, each with its package (lm.verb.Verb: add_parser, run). Here:
config overrides split off, user errors as one line (exit 2), huge pages for the process, and
SIGTERM/SIGINT handled from the start of every command (lm.train.faults.StopSignal): a training
command stops with nothing lost (exit 0, the line says how to go on); any other stops at once
with one line and the shell's code for the signal (130 for SIGINT, 143 for SIGTERM)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from lm.data import cli as data_cli
from lm.demo import cli as demo_cli
from lm.errors import UserError
from lm.eval import cli as eval_cli
from lm.eval import contamination_cli, harness_cli
from lm.infer import cli as infer_cli
from lm.infer.serve import cli as serve_cli
from lm.plan import cli as plan_cli
from lm.plan import scale_cli
from lm.store import cli as store_cli
from lm.train import cli as train_cli
from lm.train.faults import StopRequested, StopSignal, hard_exit
from lm.train.identity import record_command
from lm.verb import Stopped, Verb


def training_verbs() -> tuple[Verb, ...]:
    """The verbs that train, one per stage of the registry (lm.train.registry): SIGTERM/SIGINT stop
    them cleanly from start-up on (lm.train.faults.StopSignal)."""
    return train_cli.verbs()


def all_verbs() -> tuple[Verb, ...]:
    """In `lm --help` order; none imports jax before its `run` (the CPU flags come first)."""
    return (
        *training_verbs(),
        demo_cli,
        data_cli.Tokenizer,
        store_cli.Export,
        store_cli.Import,
        data_cli.Tokenize,
        data_cli.Curate,
        plan_cli,
        scale_cli,
        infer_cli,
        serve_cli,
        eval_cli,
        contamination_cli,
        harness_cli,
    )


TRAINING: tuple[Verb, ...] = training_verbs()  # the stages registered at import
VERBS: tuple[Verb, ...] = all_verbs()


def _verbs() -> tuple[Verb, ...]:
    """VERBS, then the verbs of stages registered since (lm.train.registry.register)."""
    return (*VERBS, *(verb for verb in training_verbs() if verb not in TRAINING))


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates `--config.a.b=v` (or `--config.a.b v`) overrides from the other arguments."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            item = arg[len("--config.") :]
            if "=" not in item:
                if i + 1 >= len(argv):
                    raise UserError(f"override '{arg}' has no value; write {arg}=VALUE")
                item, i = f"{item}={argv[i + 1]}", i + 1
            overrides.append(item)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _parser() -> tuple[argparse.ArgumentParser, dict[str, Verb]]:
    """The `lm` parser and the verb each of its sub-commands reaches."""
    p = argparse.ArgumentParser(prog="lm", description="Train language models end to end.")
    sub = p.add_subparsers(dest="verb", required=True)
    reaches = {}
    for verb in _verbs():
        verb.add_parser(sub)
        reaches.update({name: verb for name in sub.choices if name not in reaches})
    return p, reaches


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    record_command(argv)
    training = False
    try:
        rest, overrides = _split_overrides(argv)
        parser, reaches = _parser()
        args = parser.parse_args(rest)
        verb = reaches[args.verb]
        training = verb in training_verbs() and getattr(args, "action", None) is None  # `lm reward score` is not
        with StopSignal("start-up" if training else args.verb, defer=False, saved=False) as stop:
            try:
                return verb.run(args, overrides)
            except (Stopped, StopRequested, UserError) as e:
                if isinstance(e, UserError) and stop.received is not None:
                    raise StopRequested(stop.received, stop.phase, stop.saved) from e
                raise
            except Exception as e:  # whatever broke once a signal came is the signal's doing
                if stop.received is None:
                    raise
                raise StopRequested(stop.received, stop.phase, stop.saved) from e
    except UserError as e:
        _close_progress_bars()
        print(f"lm: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:  # after a checkpoint: say how to continue; exit 0 (nothing was lost)
        _stopped_midway()
        again = shlex.join(a for a in argv if a != "--resume")
        print(f"lm: {e}. Continue with: lm {again} --resume", file=sys.stderr)
        return 0
    except StopRequested as e:
        _stopped_midway()
        if not training:  # a result was cut short: the shell's code for that signal
            print(f"lm: stopped by {e.by}; {args.verb} did not finish", file=sys.stderr)
            return 128 + getattr(signal, e.by, signal.SIGINT)
        if e.saved:  # outside the loop: nothing to save; say how to go on; exit 0
            again = shlex.join([*(a for a in argv if a != "--resume"), "--resume"])
            print(f"lm: {e}; finish it with: lm {again}", file=sys.stderr)
        else:
            print(f"lm: {e}; run again with the same command: lm {shlex.join(argv)}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        _stopped_midway()
        print("lm: interrupted", file=sys.stderr)
        return 130


# set when a signal stopped the command: XLA may still be compiling on its threads (lm.train.faults.hard_exit)
_HARD_EXIT = False


def _stopped_midway() -> None:
    """A stopped command ends without the interpreter's teardown; not on several processes, whose
    runtime shuts down together with its peers at exit."""
    global _HARD_EXIT
    jax = sys.modules.get("jax")
    _HARD_EXIT = jax is None or not jax.distributed.is_initialized()
    _close_progress_bars()


def _close_progress_bars() -> None:
    """Bars a failed command left open end their line, so that its error starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def run() -> None:
    """The `lm` console script: huge-page malloc for the step's temporaries (lm.process.hugepages), then main."""
    import os

    from lm.plan.hardware import quiet_absent_tpu
    from lm.process.hugepages import reexec_with_hugepages

    quiet_absent_tpu(os.environ)
    reexec_with_hugepages()
    end(main())


def end(code: int) -> None:
    """Ends the process with `code` (what `main` returned): at once after a stop (lm.train.faults.hard_exit)."""
    if _HARD_EXIT:
        hard_exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
