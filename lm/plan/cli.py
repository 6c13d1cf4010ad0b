"""`lm plan`: params, FLOPs and per-device memory of a config's steps on a target; with --compile,
each step compiled ahead of time for it (lm.plan.aot) with the compiler's figures beside the planner's;
with --fit, the first setting that fits; with --scaling, where the config sits against a fitted scaling law
(lm.plan.scaling_report). This verb sits above lm.plan.aot."""

from __future__ import annotations

import os

from lm.train.registry import step_names
from lm.verb import with_overrides


def add_parser(sub) -> None:
    pl = with_overrides(sub, "plan", help="params, FLOPs and per-device memory of a config on a target")
    pl.add_argument("--config", default="configs/tiny.py")
    pl.add_argument(
        "--target",
        default="",
        help="what to plan for: a Cloud TPU slice (v4-N, v5e-N, v5p-N, v6e-N; N as in the slice's "
        "name) or cpu:N (N simulated CPU devices); default: the summary alone",
    )
    names = step_names()  # the stage registry's compiled steps (lm.train.registry)
    pl.add_argument("--steps", default=names[0], help=f"comma-separated, among {','.join(names)} (or 'all')")
    pl.add_argument(
        "--compile",
        action="store_true",
        help="compile each step ahead of time for the target (a TPU slice needs lm[tpu]); nothing is allocated",
    )
    pl.add_argument(
        "--fit",
        action="store_true",
        help="if a step does not fit, search remat, micro-batches and fsdp x context x tensor for the "
        "first setting that does, compiled to confirm",
    )
    pl.add_argument(
        "--scaling",
        default="",
        help="a scaling.json from `lm scale`: the config's N and D against the fitted optimum for its compute",
    )


def _steps(text: str) -> tuple:
    from lm.errors import UserError

    names = step_names()
    steps = names if text == "all" else tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in steps if s not in names]
    if unknown or not steps:
        raise UserError(f"--steps {text}: unknown {unknown or 'nothing'}; expected some of {','.join(names)} or 'all'")
    return steps


def run(args, overrides) -> int:
    from lm.config import load_config
    from lm.plan.hardware import parse_target
    from lm.plan.units import summary

    if (args.fit or args.compile) and not args.target.strip():
        from lm.errors import UserError

        flag = "--fit" if args.fit else "--compile"
        raise UserError(
            f"lm plan {flag} needs --target (a Cloud TPU slice such as v5e-8, or cpu:N): it compiles "
            "the steps for that target"
        )
    config = load_config(args.config, overrides)
    target = parse_target(args.target) if args.target else None
    steps = _steps(args.steps)
    t = config.train
    print(summary(config.model, config.data.seq_len, train_tokens=t.steps * t.batch_size * config.data.seq_len))
    if args.scaling:
        from lm.plan.scaling_report import against, read_report

        print(against(config, read_report(args.scaling)))
    if target is None:
        return 0
    # before jax is first imported: simulated CPU devices, or the CPU backend beside a TPU topology
    os.environ["JAX_PLATFORMS"] = "cpu"
    if target.platform == "cpu":
        from lm.process.cpu_flags import apply_cpu_defaults

        apply_cpu_defaults(config.model.compute_dtype)
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={target.chips}".strip()
        )
    from lm.plan.report import plan_target

    return plan_target(config, target, steps, compile_=args.compile or args.fit, fit=args.fit)
