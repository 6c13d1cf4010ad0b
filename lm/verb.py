"""What every `lm` verb shares: the (add_parser, run) contract, the config-overrides epilog, and the
signal a verb raises when a run was stopped (the edge knows the command line to continue it)."""

from __future__ import annotations

import argparse
from typing import Protocol

OVERRIDES_HELP = """config overrides:
  any key of the config can be set after the other arguments as --config.SECTION.KEY=VALUE
  (or --config.SECTION.KEY VALUE), e.g. --config.optim.lr=1e-3 --config.mesh.fsdp=2
  --config.data.corpus=/path/to/texts; every key, its default and type: lm/config/ (one module per section).
  Unknown keys and wrong types stop with the dotted key and what was expected."""


class Verb(Protocol):
    """A verb of `lm`: a module or a small object. Building its parser must not import jax (the CPU
    flags are set later, in `run`, once the config is known)."""

    def add_parser(self, sub) -> None: ...

    def run(self, args: argparse.Namespace, overrides: list[str]) -> int: ...


class Stopped(Exception):
    """A signal ended a run where nothing was lost: --resume continues it. `during`: where (a demo's
    stage); `kept`: what a resume starts from."""

    def __init__(self, by: str, step: int | None = None, during: str | None = None, kept: str = "checkpoint saved"):
        where = "".join([f" during {during}" if during else "", f" at step {step}" if step is not None else ""])
        super().__init__(f"stopped by {by}{where}; {kept}")
        self.by, self.step, self.during = by, step, during


def with_overrides(sub, name: str, **kw) -> argparse.ArgumentParser:
    """A verb's parser whose help ends with how to override config keys."""
    return sub.add_parser(name, epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


RUN_HELP = "a run's workdir (`lm train`, `lm sft`, `lm dpo`, `lm rl`, ...): its newest checkpoint"
MODEL_HELP = "an `lm export` (a directory or a .safetensors file) or a Hugging Face model directory"


def add_model_source(p, required: bool = True, run: str = RUN_HELP, params: str = MODEL_HELP):
    """The model a verb reads: --workdir RUN or --params EXPORT_OR_HF_DIR (lm.store.load.load_trained
    takes either). Returns the group, for verbs that add a third choice."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--workdir", help=run)
    src.add_argument("--params", help=params)
    return src


def add_kv_cache(p: argparse.ArgumentParser) -> None:
    """--kv-cache, as `lm sample` and `lm serve` take it (lm.infer.engine.request.EngineConfig.kv_cache)."""
    p.add_argument(
        "--kv-cache",
        choices=("int8", "fp8"),
        default="",
        help="the KV cache's pages as int8 (a scale per token and kv head) or float8 e4m3: about half "
        "the cache memory of bfloat16 (default: the compute dtype)",
    )


def add_distributed(p: argparse.ArgumentParser) -> None:
    """The multi-host flags every verb that runs a model takes (`start_distributed` acts on them)."""
    g = p.add_argument_group(
        "multi-host",
        "every process runs the same command; process 0 alone writes files and prints results (docs/multihost.md)",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (auto-detects TPU pods, Slurm, ...)",
    )
    g.add_argument("--coordinator", help="host:port of process 0 (else auto-detected; implies --distributed)")
    g.add_argument("--num-processes", type=int, help="number of processes (implies --distributed)")
    g.add_argument("--process-id", type=int, help="this process's index (implies --distributed)")
    g.add_argument(
        "--startup-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="how long a process waits for every other one to join; then it ends with one line "
        "naming who is missing (default: 300)",
    )
    g.add_argument(
        "--peer-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="once joined, a process silent this long (killed, crashed, its host gone) ends every "
        "other one, at any point of the command, with one line naming it, the last step and "
        "the checkpoint to resume from (exit 75; default: 60)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds from 1 to 86400, got {text!r}")
    return value


def start_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize() when the flags of `add_distributed` ask for it: after the CPU
    flags are set, before any computation. A coordinator, a count or an index alone also asks (a
    process that ran alone would write the same files as its peers). Joining is bounded by
    --startup-timeout, and from then on a lost process ends the others (lm.process.peers). Calling it again
    is a no-op."""
    values = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in values):
        return
    from lm.process import peers

    launch = peers.Launch(
        args.startup_timeout,
        args.peer_timeout,
        resumable=hasattr(args, "resume"),
        resumed=bool(getattr(args, "resume", False)),
    )
    peers.start(*values, launch)


def is_main() -> bool:
    """Whether this process prints results and writes files (process 0; the only one without --distributed)."""
    import jax

    return jax.process_index() == 0
