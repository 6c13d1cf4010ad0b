"""`lm demo`: the whole pipeline on the tiny model (lm.demo.pipeline), printing what each stage gained."""

from __future__ import annotations

from lm.verb import with_overrides


def add_parser(sub) -> None:
    dm = with_overrides(
        sub,
        "demo",
        help="the whole pipeline on the tiny model, printing what each stage gained",
        description="Pretrains the tiny model on the Python standard library, then fine-tunes it "
        "(fully and with LoRA) on a generated sort task, then trains DPO and a reward "
        "model on its preference pairs and GRPO on its prompts; prints one evidence "
        "table. Overrides apply to the pretraining config. SIGTERM/SIGINT stop the stage "
        "in progress cleanly and start no later one; --resume then goes on.",
    )
    dm.add_argument("--workdir", required=True, help="directory for every stage's run")
    dm.add_argument(
        "--resume",
        action="store_true",
        help="go on with a stopped demo: a stage whose run finished (its summary.json) is not run "
        "again, the stopped one resumes from its newest checkpoint",
    )
    dm.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")


def run(args, overrides) -> int:
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("float32")  # before anything imports jax (the tiny model is float32)
    from lm.demo.pipeline import run_demo

    run_demo(args.workdir, show_progress=not args.no_progress, pretrain_overrides=overrides, resume=args.resume)
    return 0
