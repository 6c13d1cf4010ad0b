"""`lm contamination`: n-gram overlap between eval task files and the training data, and the
scores of an `lm eval` report on the clean examples."""

from __future__ import annotations

import json
import pathlib

from lm.errors import UserError
from lm.outputs import check_out, write_text


def add_parser(sub) -> None:
    from lm.eval.contamination import MIN_WORDS, N

    p = sub.add_parser(
        "contamination",
        help="find eval examples whose n-grams occur in the training data",
        description="An eval example is contaminated when n consecutive words of it (lowercased) "
        "occur in one training document; shorter examples are checked whole. With "
        "--report, the tasks of an `lm eval` report are rescored on the clean examples.",
    )
    p.add_argument(
        "--train",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="training data: a token shard dir (`lm tokenize`), stdlib, a directory, a glob or a file",
    )
    p.add_argument("--eval", nargs="+", required=True, metavar="FILE", help="task JSONL files, as given to `lm eval`")
    p.add_argument("--n", type=int, default=N, help=f"words per n-gram (default {N})")
    p.add_argument(
        "--min-words",
        type=int,
        default=None,
        help=f"shorter examples are not checked (default {MIN_WORDS}, at most --n)",
    )
    p.add_argument("--tokenizer", help="'byte' or a sentencepiece .model, to decode shard sets (default: byte)")
    p.add_argument("--report", metavar="EVAL_REPORT.json", help="an `lm eval --out` report to rescore")
    p.add_argument("--out", help="write the JSON contamination report (and the clean scores) here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, overrides=()) -> int:
    from lm.eval.contamination import check, clean_subset, table
    from lm.eval.report import read_report

    for f in args.eval:
        if not pathlib.Path(f).is_file():
            raise UserError(f"--eval {f}: no such file")
    if args.out is not None:
        check_out(args.out, args.overwrite)
    eval_report = read_report(args.report, "--report") if args.report else None  # before the long scan
    report = check(
        args.train,
        args.eval,
        n=args.n,
        min_words=args.min_words,
        tokenizer=args.tokenizer,
        progress=not args.no_progress,
    )
    clean = None
    if eval_report is not None:
        clean = clean_subset(eval_report, report)
        if not clean:
            raise UserError(
                f"--report {args.report}: no task of it was read from the --eval files "
                f"({', '.join(args.eval)}); give the task files the report was made from"
            )
        report["clean"] = clean
    print(table(report, clean))
    if args.out:
        write_text(args.out, json.dumps(report, indent=1))
    return 0
