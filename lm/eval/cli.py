"""`lm eval`: tasks against a trained model (a JSON report and a table), or two reports compared."""

from __future__ import annotations

import json

from lm.errors import UserError
from lm.outputs import check_out, write_text
from lm.verb import add_distributed, add_model_source, is_main, start_distributed


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        epilog="--config.mesh.KEY=VALUE / --config.eval.KEY=VALUE: the mesh and batch "
        "size to evaluate with (default: the run's own)",
        help="evaluate a model: bits per byte, multiple choice, generation tasks",
        description="Scores a run or an export on tasks given as [NAME=]PATH[?key=value&...] "
        "(lm/eval/tasks.py lists the kinds and options), or compares two reports.",
    )
    src = add_model_source(p, required=False)
    src.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="two reports side by side")
    p.add_argument("--tasks", nargs="+", default=[], help="task specs, e.g. heldout=data.jsonl mmlu=mc.jsonl?shots=5")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--batch-size", type=int, default=0, help="rows per scoring batch (default: eval.batch_size)")
    p.add_argument("--tokenizer", help="a sentencepiece .model (default: the one the model was trained with)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--quantize",
        choices=("none", "int8", "int4"),
        default="none",
        help="weight-only quantization of the model for this evaluation (int8 per channel, int4 per group)",
    )
    add_distributed(p)


def evaluate(
    loaded, specs: list[str], batch_size: int = 0, progress: bool = True, overrides=(), quantize: str = "none"
) -> dict:
    """The report of `specs` (task specs) for a loaded model (lm.store.load.Loaded). overrides:
    `mesh.*` / `eval.*` config keys for this evaluation (e.g. a smaller mesh than training's)."""
    from tqdm import tqdm

    from lm.eval.loglik import Scorer
    from lm.eval.tasks import parse_task, run_task

    tasks = [parse_task(s) for s in specs]  # every spec checked before any scoring
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise UserError(f"task names repeat ({', '.join(names)}); name them: NAME=PATH")
    config = None
    if overrides:
        from lm.config import apply_overrides, freeze, thaw, validate

        if any(not o.startswith(("mesh.", "eval.")) for o in overrides):
            raise UserError("lm eval: only mesh.* and eval.* keys can be overridden (the model is the trained one)")
        config = thaw(loaded.config)
        apply_overrides(config, list(overrides))
        validate(config)
        config = freeze(config)
    scorer = Scorer.from_loaded(loaded, batch_size or None, config, quantize)
    report = {"model": loaded.source, "tasks": {}} | ({"quantize": quantize} if quantize != "none" else {})
    for task in tasks:
        with tqdm(desc=f"eval {task.name}", unit="req", disable=not progress, leave=False) as bar:
            report["tasks"][task.name] = run_task(task, scorer, bar.update)
    return report


def run(args, overrides=()) -> int:
    from lm.eval.report import compare, compare_table, read_report, table

    if args.out is not None:  # before any work: a report nobody can write is refused first
        check_out(args.out, args.overwrite)
    if args.compare:
        a, b = (read_report(p, "--compare") for p in args.compare)
        result = compare(a, b)
        print(compare_table(a, b, result))
        if args.out:
            write_text(args.out, json.dumps(result, indent=2))
        return 0
    if not args.tasks:
        raise UserError("lm eval: give --tasks SPEC [SPEC ...] (and --workdir or --params), or --compare A B")
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("float32")
    start_distributed(args)
    from lm.store.load import load_trained

    # every process scores every request (the model spans them all) and so holds the whole report
    main = is_main()
    report = evaluate(
        load_trained(args.workdir, args.params, args.tokenizer),
        args.tasks,
        args.batch_size,
        not args.no_progress and main,
        overrides,
        args.quantize,
    )
    if main:
        print(table(report))
        if args.out:
            write_text(args.out, json.dumps(report, indent=1))
    return 0
