"""`lm harness`: lm-evaluation-harness tasks (its own or local YAML ones) against an `lm` model."""

from __future__ import annotations

import json
import os

from lm.outputs import check_out, write_text
from lm.verb import add_distributed, add_model_source, is_main, start_distributed


def add_parser(sub) -> None:
    p = sub.add_parser(
        "harness",
        help="run lm-evaluation-harness tasks against a run or an export",
        description="Any lm-evaluation-harness task, through its model interface (loglikelihood, "
        "loglikelihood_rolling, generate_until) over `lm eval`'s scoring. Local tasks: "
        "YAML files in --include-path. Needs pip install 'lm[harness]'.",
    )
    add_model_source(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", help="a directory of task YAML files")
    p.add_argument("--limit", type=int, help="the first N examples of each task")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, help="rows per scoring batch (default: eval.batch_size)")
    p.add_argument("--tokenizer", help="a sentencepiece .model (default: the model's own)")
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="prompts in the chat template (lm.data.chat), few-shot examples as turns",
    )
    p.add_argument("--offline", action="store_true", help="never reach the Hugging Face Hub (local datasets only)")
    p.add_argument("--verbose", action="store_true", help="the harness's own info logs and progress bars")
    p.add_argument("--out", help="write the harness's results (JSON) here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_distributed(p)


def run(args, overrides=()) -> int:
    if args.out is not None:
        check_out(args.out, args.overwrite)
    if args.offline:  # read when the datasets library is imported
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # the harness's bootstrap would fork a process running jax
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("float32")
    start_distributed(args)
    from lm.eval.harness import harness_table, run_harness

    if args.verbose:
        from lm_eval.utils import setup_logging

        setup_logging()

    results = run_harness(
        workdir=args.workdir,
        params=args.params,
        tasks=[t for t in args.tasks.split(",") if t],
        include_path=args.include_path,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        tokenizer=args.tokenizer,
        apply_chat_template=args.apply_chat_template,
        verbose=args.verbose,
    )
    # each process is the harness's only rank (it shards no requests), so all hold the same results
    if is_main():
        print(harness_table(results))
        if args.out:
            write_text(args.out, json.dumps(results, indent=1, default=str))
    return 0
