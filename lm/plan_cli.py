"""`lm plan`: params, FLOPs and memory of a config; with --compile, the train step compiled ahead of
time (lm.aot), which is why this verb sits above lm.aot."""

from __future__ import annotations

import os

from lm.verb import with_overrides


def add_parser(sub) -> None:
    pl = with_overrides(sub, "plan", help="params, FLOPs and memory of a config")
    pl.add_argument("--config", default="configs/tiny.py")
    pl.add_argument("--compile", action="store_true",
                    help="also compile the train step ahead of time on the mesh (nothing is allocated)")
    pl.add_argument("--devices", type=int, default=0,
                    help="plan for this many devices (a -1 mesh axis takes what is left); with --compile, "
                         "simulate them as CPU devices (for meshes larger than this machine)")


def run(args, overrides) -> int:
    from lm import plan
    from lm.config import load_config
    from lm.cpu_flags import apply_cpu_defaults

    config = load_config(args.config, overrides)
    apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
    print(plan.summary(config.model, config.data.seq_len))
    if args.devices:  # must happen before jax is first imported
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    fsdp, tensor = config.mesh.fsdp, config.mesh.tensor
    if args.devices:
        from lm.sharding import mesh_shape

        _, fsdp, tensor = mesh_shape(config.mesh, args.devices)
    if fsdp > 0 and tensor > 0:  # a -1 among them takes what is left of --devices
        print(plan.memory_summary(config.model, fsdp=fsdp, tensor=tensor))
    if args.compile:
        from lm.aot import compile_train_step

        figures = compile_train_step(config)
        micro_rows = config.train.batch_size // config.train.micro_batches
        rows = max(1, micro_rows // (figures["mesh"]["data"] * figures["mesh"]["fsdp"]))
        print(plan.compile_report(figures, config.model, config.data.seq_len, rows))
    return 0
