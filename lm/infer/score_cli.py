"""`lm reward score`: a reward model's scores for texts, or for preference pairs with their accuracy."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys

from lm.errors import UserError
from lm.outputs import atomic_open, check_out
from lm.verb import add_model_source


def add_parser(sub) -> None:
    """Adds `score` to `lm reward`'s sub-actions (lm.train.cli)."""
    p = sub.add_parser(
        "score",
        help="print a reward model's scores",
        description="Scores with a reward model trained by `lm reward`. --texts: JSONL lines "
        '{"prompt", "response"} or chat {"messages": [..., assistant turn]}; --pairs: '
        "preference pairs, scored on both sides, with the share ranked correctly.",
    )
    add_model_source(p, run="an `lm reward` workdir (its newest checkpoint)", params="an `lm export` of a reward model")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--texts", help="JSONL of responses to score")
    what.add_argument("--pairs", help='JSONL preference pairs {"prompt", "chosen", "rejected"}')
    p.add_argument("--out", help="write one JSON line per input with its score(s) (default: stdout)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--limit", type=int, default=0, help="score only the first N lines (0 = all)")
    p.add_argument("--tokenizer", help="a sentencepiece .model (default: the one the run was trained with)")


def run(args, overrides=()) -> int:
    if args.out is not None:
        check_out(args.out, args.overwrite)
    from lm.process.cpu_flags import apply_cpu_defaults

    apply_cpu_defaults("float32")
    from lm.infer.score import RewardScorer, read_texts
    from lm.store.load import load_trained

    path = args.texts or args.pairs
    if not pathlib.Path(path).is_file():
        raise UserError(f"{'--texts' if args.texts else '--pairs'} {path}: no such file")
    scorer = RewardScorer(load_trained(args.workdir, args.params, args.tokenizer))
    # written beside --out and renamed at the end: an interrupted run leaves --out as it was
    with atomic_open(args.out) if args.out else contextlib.nullcontext(sys.stdout) as out:
        if args.texts:
            texts = read_texts(path)[: args.limit or None]
            for messages, score in zip(texts, scorer.score(texts)):
                out.write(json.dumps({"messages": messages, "score": float(score)}) + "\n")
            summary = {"texts": len(texts)}
        else:
            from lm.data.preference import read_pairs

            pairs = [(p + [c], p + [r]) for p, c, r, _ in read_pairs(path, args.limit)]
            scores = scorer.score([c for pair in pairs for c in pair]).reshape(-1, 2)
            for (chosen, _), (sc, sr) in zip(pairs, scores):
                out.write(
                    json.dumps({"prompt": chosen[:-1], "chosen_score": float(sc), "rejected_score": float(sr)}) + "\n"
                )
            summary = {
                "pairs": len(pairs),
                "accuracy": float((scores[:, 0] > scores[:, 1]).mean()),
                "mean_margin": float((scores[:, 0] - scores[:, 1]).mean()),
            }
    if scorer.truncated:
        summary["truncated_to_context"] = scorer.truncated
    print(json.dumps(summary), file=sys.stderr)
    return 0
