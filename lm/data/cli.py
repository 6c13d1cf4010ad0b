"""`lm tokenizer train`, `lm tokenize`, `lm curate`: verbs over the data pipeline."""

from __future__ import annotations

from lm.errors import UserError
from lm.outputs import check_out
from lm.verb import with_overrides


class Tokenizer:
    """`lm tokenizer train`: a sentencepiece BPE tokenizer from a corpus."""

    @staticmethod
    def add_parser(sub) -> None:
        tk = sub.add_parser("tokenizer", help="train a sentencepiece BPE tokenizer on a corpus")
        tk.add_argument("action", choices=["train"])
        tk.add_argument("--corpus", default="stdlib", help="'stdlib', a directory or a glob (train split only)")
        tk.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
        tk.add_argument("--vocab-size", type=int, default=8192)
        tk.add_argument("--max-bytes", type=int, default=50_000_000, help="cap on training text")
        tk.add_argument("--heldout-fraction", type=float, default=0.02, help="as data.heldout_fraction")
        tk.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model and PREFIX.vocab")

    @staticmethod
    def run(args, overrides) -> int:
        from lm.data.prepare import train_corpus_tokenizer

        if not args.out.strip() or args.out.endswith(("/", "\\")):
            raise UserError(
                f"--out {args.out!r}: expected a file prefix such as runs/tok/stdlib (writes "
                "PREFIX.model and PREFIX.vocab)"
            )
        for suffix in (".model", ".vocab"):  # before reading any text
            check_out(args.out + suffix, args.overwrite)

        tok = train_corpus_tokenizer(args.corpus, args.heldout_fraction, args.out, args.vocab_size, args.max_bytes)
        print(f"wrote {tok.path} ({tok.vocab_size} pieces, {tok.fingerprint()}); trained on {tok.train_stats}")
        print(f"use it with --config.data.tokenizer={tok.path} (model.vocab_size must be >= {tok.vocab_size})")
        return 0


class Tokenize:
    """`lm tokenize`: a corpus into train / held-out token shards."""

    @staticmethod
    def add_parser(sub) -> None:
        tz = sub.add_parser("tokenize", help="tokenize a corpus into train / held-out token shards")
        tz.add_argument(
            "--corpus", default="stdlib", help="'stdlib', a directory or a glob of text or JSONL(.gz) files"
        )
        tz.add_argument("--out", required=True, help="output directory: writes OUT/train and OUT/heldout")
        tz.add_argument("--tokenizer", default="byte", help="'byte' or a sentencepiece .model file")
        tz.add_argument("--heldout-fraction", type=float, default=0.02, help="as data.heldout_fraction")
        tz.add_argument("--max-bytes", type=int, default=0, help="cap on train input (whole files; 0 = all)")
        tz.add_argument("--workers", type=int, default=0, help="tokenizing processes (0 = all cores)")
        tz.add_argument("--no-progress", action="store_true", help="no progress bar")

    @staticmethod
    def run(args, overrides) -> int:
        from lm.data.shards import tokenize_corpus

        # shards of the same inputs are kept (nothing to do), of others refused: no --overwrite to check
        check_out(args.out, overwrite=True, kind="dir")

        manifests = tokenize_corpus(
            args.corpus,
            args.out,
            args.tokenizer,
            args.heldout_fraction,
            max_train_bytes=args.max_bytes,
            workers=args.workers,
            progress=not args.no_progress,
        )
        for split, m in manifests.items():
            print(
                f"{split}: {m['n_docs']:,} docs, {m['n_tokens']:,} tokens ({m['dtype']}) from {m['n_bytes']:,} "
                f"bytes in {len(m['shards'])} shard(s); skipped {m['skipped']}"
            )
        print(f"use it with --config.data.sources={args.out} --config.data.tokenizer={args.tokenizer}")
        return 0


class Curate:
    """`lm curate`: raw text into deduplicated, filtered, redacted JSONL.gz shards."""

    @staticmethod
    def add_parser(sub) -> None:
        cu = with_overrides(sub, "curate", help="dedup, filter, language-id and redact raw text into JSONL.gz shards")
        cu.add_argument(
            "--input",
            action="append",
            required=True,
            help="a file, directory or glob (.txt/.py/any text, .jsonl[.gz|.zst], .parquet) or 'stdlib'; repeatable",
        )
        cu.add_argument("--out", required=True, help="output directory: part-*.jsonl.gz shards and report.json")
        cu.add_argument("--config", default="configs/tiny.py", help="a config file; its `curate` section is used")
        cu.add_argument("--workers", type=int, default=1, help="parallel processes")
        cu.add_argument("--no-progress", action="store_true", help="no progress bar")

    @staticmethod
    def run(args, overrides) -> int:
        from pathlib import Path

        from lm.config import load_config
        from lm.process.cpu_flags import apply_cpu_defaults

        _check_curate_out(Path(args.out), args.input)
        config = load_config(args.config, overrides)
        apply_cpu_defaults(config.model.compute_dtype)  # before anything imports jax
        from lm.data.curate import curate

        report = curate(args.input, Path(args.out), config.curate, workers=args.workers, progress=not args.no_progress)
        print(
            f"kept {report['kept']['docs']:,} of {report['in']['docs']:,} documents; "
            f"wrote {len(report['shards'])} shard(s) and report.json to {args.out}"
        )
        return 0


def _check_curate_out(out, inputs: list[str]) -> None:
    """`lm curate` replaces the part-*.jsonl.gz shards and report.json of an earlier curation in
    --out: refused where they would be anything else (an input, or shards no curation wrote)."""
    import glob
    from pathlib import Path

    check_out(out, overwrite=True, kind="dir")  # an earlier curation there is updated or replaced
    full = out.resolve()
    for spec in inputs:
        for found in glob.glob(spec) or [spec]:
            path = Path(found).resolve()
            if path.exists() and (path == full or full in path.parents):
                raise UserError(
                    f"--out {out}: holds the --input {spec}; curate replaces the part-*.jsonl.gz files "
                    "of its --out: choose a directory of its own"
                )
    if out.is_dir() and list(out.glob("part-*.jsonl.gz")) and not (out / "report.json").is_file():
        raise UserError(
            f"--out {out}: holds part-*.jsonl.gz files that no `lm curate` wrote (no report.json); "
            "curate would replace them: choose another directory"
        )
