"""`lm export`: the params of a training checkpoint as an orbax directory or a .safetensors file."""

from __future__ import annotations


def add_parser(sub) -> None:
    ex = sub.add_parser("export", help="write the params of a training checkpoint (orbax dir or .safetensors)")
    ex.add_argument("--workdir", required=True, help="the `lm train` workdir holding checkpoints/")
    ex.add_argument("--step", type=int, help="which checkpoint (default: the newest)")
    ex.add_argument("--out", required=True, help="a directory (orbax) or a file ending in .safetensors")
    ex.add_argument("--format", choices=["orbax", "safetensors"], help="default: from the --out suffix")
    ex.add_argument("--merge", action="store_true",
                    help="a LoRA run: fold the adapters into their base and export a plain model (default: the "
                         "adapters alone, which `lm sample` folds into the base named in their config)")


def run(args, overrides=()) -> int:
    from lm.store.export import export_params

    done = export_params(args.workdir, args.out, args.step, args.format, merge=args.merge)
    print(f"wrote {done['params']:,} params of step {done['step']} to {done['out']} ({done['format']}); "
          "read them with lm.store.load.load_params")
    return 0
