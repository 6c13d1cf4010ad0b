"""`lm export`: a model as an orbax directory or a .safetensors file (our layout), a Hugging Face
model directory, or a LoRA run's adapters as a PEFT adapter. `lm import hf`: a Hugging Face model
directory into our layout."""

from __future__ import annotations

import re

from lm.errors import UserError
from lm.verb import add_model_source

FORMATS = ("orbax", "safetensors", "hf", "peft")
OVERWRITE_HELP = (
    "replace an existing --out: a file, or in a directory the files this writes (nothing else there is touched)"
)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def byte_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in UNITS or float(match.group(1)) * UNITS[unit] < 1:
        raise UserError(f"--shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[unit])


class Export:
    """`lm export`: the params of a run (or of an export, or an HF directory) for use elsewhere."""

    @staticmethod
    def add_parser(sub) -> None:
        ex = sub.add_parser("export", help="write a model: orbax dir, .safetensors, Hugging Face dir or PEFT adapter")
        add_model_source(ex)
        ex.add_argument("--step", type=int, help="which checkpoint of --workdir (default: the newest)")
        ex.add_argument("--out", required=True, help="a directory (orbax, hf, peft) or a file ending in .safetensors")
        ex.add_argument(
            "--format",
            choices=FORMATS,
            help="orbax | safetensors (our layout; default: from the --out suffix), hf (a directory "
            "transformers' AutoModelForCausalLM and AutoTokenizer load), peft (a LoRA run's adapters "
            "as a PEFT adapter over its base)",
        )
        ex.add_argument(
            "--merge",
            action="store_true",
            help="a LoRA run: fold the adapters into their base and export a plain model (default: the "
            "adapters alone, which `lm sample` folds into the base named in their config; --format "
            "hf needs --merge)",
        )
        ex.add_argument(
            "--dtype",
            choices=("float32", "bfloat16", "float16"),
            help="hf and peft: the tensors' dtype (default: as held; float32 for a model trained here)",
        )
        ex.add_argument(
            "--quantize",
            choices=("int8", "int4"),
            help="write the weights quantized (int8 per channel, int4 per group of 128) to a .safetensors "
            "--out; `--params OUT` then loads them quantized",
        )
        ex.add_argument("--shard-size", default="5GB", help="hf: the largest safetensors shard (default 5GB)")
        ex.add_argument(
            "--base-model",
            help="peft: base_model_name_or_path in adapter_config.json (default: the "
            "Hugging Face directory the run started from, when it did)",
        )
        ex.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    @staticmethod
    def run(args, overrides=()) -> int:
        fmt = args.format
        if args.step is not None and args.params:
            raise UserError("lm export: --step picks a checkpoint of --workdir; an export or HF directory has one")
        if args.dtype and fmt not in ("hf", "peft"):
            raise UserError("lm export: --dtype applies to --format hf and peft (our layouts keep the params as held)")
        if args.base_model and fmt != "peft":
            raise UserError("lm export: --base-model applies to --format peft")
        if args.quantize and (fmt not in (None, "safetensors") or args.merge or args.dtype):
            raise UserError(
                "lm export --quantize writes our .safetensors layout (adapters folded in): drop "
                "--format/--merge/--dtype"
            )
        _check_out(args, fmt)
        if args.quantize:
            from lm.store.export import export_quantized
            from lm.store.load import load_trained

            done = export_quantized(load_trained(args.workdir, args.params, step=args.step), args.out, args.quantize)
            print(
                f"wrote {done['params']:,} params quantized ({done['format']}, {done['bytes']:,} bytes) to "
                f"{done['out']}; lm sample/eval/serve --params read it back quantized"
            )
            return 0
        if fmt in ("hf", "peft"):
            return _export_hf(args)
        if args.params:
            from lm.store.export import export_loaded
            from lm.store.load import load_trained

            done = export_loaded(load_trained(params=args.params, merge_adapters=False), args.out, fmt, args.merge)
            what = args.params
        else:
            from lm.store.export import export_params

            done = export_params(args.workdir, args.out, args.step, fmt, merge=args.merge)
            what = f"step {done['step']}"
        print(
            f"wrote {done['params']:,} params of {what} to {done['out']} ({done['format']}); "
            "read them with lm.store.load.load_params"
        )
        return 0


def _check_out(args, fmt: str | None) -> None:
    """--out checked before anything is loaded: its layout, and that it may be written."""
    from lm.outputs import check_out

    if args.quantize:
        from lm.store.export import quantized_out

        quantized_out(args.out)
        kind = "file"
    elif fmt in ("hf", "peft"):
        kind = "dir"
    else:
        from lm.store.export import out_layout

        kind = "file" if out_layout(args.out, fmt)[1] == "safetensors" else "dir"
    check_out(args.out, args.overwrite, "--out", kind)


def _export_hf(args) -> int:
    from lm.store.hf.export import export_hf, export_peft
    from lm.store.load import load_trained

    max_bytes = byte_size(args.shard_size)
    model = load_trained(workdir=args.workdir, params=args.params, step=args.step, merge_adapters=False)
    if args.format == "hf":
        done = export_hf(model, args.out, merge=args.merge, dtype=args.dtype, max_bytes=max_bytes)
        print(
            f"wrote {done['params']:,} params as {done['architecture']} ({done['dtype']}, {len(done['files'])} "
            f"weight file(s)) with its tokenizer to {done['out']}; load it with "
            "transformers.AutoModelForCausalLM.from_pretrained"
        )
        return 0
    if args.merge:
        raise UserError(
            "lm export: --merge writes a plain model; use --format hf --merge (--format peft writes the adapters alone)"
        )
    done = export_peft(model, args.out, base=args.base_model, dtype=args.dtype)
    base = done["base"] or (
        "its base (write it with `lm export --params BASE --format hf` and name it with --base-model)"
    )
    print(
        f"wrote LoRA adapters (r={done['rank']}, {', '.join(done['targets'])}; {done['params']:,} params) to "
        f"{done['out']}; load them with peft.PeftModel.from_pretrained over {base}"
    )
    return 0


class Import:
    """`lm import hf DIR --out EXPORT`: a Hugging Face model directory as our export."""

    @staticmethod
    def add_parser(sub) -> None:
        im = sub.add_parser("import", help="convert a Hugging Face model directory into an lm export")
        im.add_argument("kind", choices=["hf"], help="hf: a directory save_pretrained wrote (config.json, safetensors)")
        im.add_argument("path", help="the Hugging Face model directory")
        im.add_argument("--out", required=True, help="a directory (orbax) or a file ending in .safetensors")
        im.add_argument("--format", choices=("orbax", "safetensors"), help="default: from the --out suffix")
        im.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    @staticmethod
    def run(args, overrides=()) -> int:
        from lm.store.hf.config import is_hf_dir

        if not is_hf_dir(args.path):
            raise UserError(
                f"lm import hf: '{args.path}' is not a Hugging Face model directory (no config.json "
                "naming a model_type)"
            )
        from lm.outputs import check_out
        from lm.store.export import export_loaded, out_layout
        from lm.store.hf.reader import load_hf

        check_out(
            args.out,
            args.overwrite,
            "--out",
            "file" if out_layout(args.out, args.format)[1] == "safetensors" else "dir",
        )
        done = export_loaded(load_hf(args.path), args.out, args.format)
        print(
            f"wrote {done['params']:,} params of {args.path} to {done['out']} ({done['format']}); use it with "
            f"--params {done['out']}"
        )
        return 0
