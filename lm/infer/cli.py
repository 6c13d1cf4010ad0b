"""`lm sample`: completions from a trained run or an export, one prompt (streamed) or a JSONL file;
with --draft, by speculative decoding in the engine (lm.infer.engine.spec_steps)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

from lm.data.records import read_records
from lm.errors import UserError
from lm.outputs import atomic_open, check_out
from lm.verb import add_distributed, add_kv_cache, add_model_source, is_main, start_distributed

BATCH = 16  # prompts decoded together from a --prompts file
DRAFT_K = 4  # tokens drafted per speculative step


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text with the KV cache from a run or an export",
        description="Generate from `lm train`'s newest checkpoint (--workdir) or an `lm export` "
        "(--params). One --prompt streams its completion to stdout; --prompts reads "
        'JSONL lines {"prompt": TEXT, ...} and writes each line back with its completion.',
    )
    add_model_source(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; the completion streams as it is generated")
    what.add_argument("--prompts", help='a JSONL file of {"prompt": ...} objects')
    p.add_argument(
        "--out",
        help="with --prompts: where to write the JSONL results (default: stdout); written "
        "beside and renamed at the end, so an interrupted run leaves it as it was",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    p.add_argument("--tokenizer", help="a sentencepiece .model (default: the one the run was trained with)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=BATCH,
        help="prompts decoded together (the engine's slots: a prompt takes the next free one)",
    )
    p.add_argument(
        "--quantize",
        choices=("none", "int8", "int4"),
        default="none",
        help="weight-only quantization: int8 per output channel, int4 per group of 128 inputs",
    )
    add_kv_cache(p)
    p.add_argument(
        "--draft",
        metavar="WORKDIR|EXPORT|ngram",
        help="speculative decoding in the engine, every prompt of the batch at once: 'ngram' for prompt "
        "lookup (the tokens that followed the context's last 3, 2 or 1 tokens earlier on), or drafts "
        "from a smaller model with the same tokenizer (an `lm train` workdir, an `lm export` or a "
        "Hugging Face directory) on the same mesh. Greedy output is unchanged; sampled output has the "
        "same distribution",
    )
    p.add_argument("--draft-k", type=int, help=f"with --draft: tokens drafted per step (>= 1; default {DRAFT_K})")
    p.add_argument(
        "--chat",
        action="store_true",
        help="answer as the assistant with the chat template: --prompt is a user turn; --prompts lines "
        'may hold {"messages": [...]} (ending with a user turn) instead of a prompt',
    )
    add_distributed(p)


def read_prompts(path: str, chat: bool = False) -> list[dict]:
    file = pathlib.Path(path)
    if not file.exists():  # a file, or a datasets folder (lm.data.records)
        raise UserError(f"--prompts {path}: no such file")

    def prompt_row(row) -> dict:
        if chat and isinstance(row, dict) and isinstance(row.get("messages"), list):
            return row
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            expected = '"prompt" string or a "messages" list' if chat else 'string "prompt"'
            raise ValueError(f"expected an object with a {expected} field")
        if not row["prompt"]:
            raise ValueError("the prompt is empty")
        return row

    line = '{"prompt": TEXT} or {"messages": [...]}' if chat else '{"prompt": TEXT}'
    rows = read_records(
        path, prompt_row, what="prompts", expected=f"one {line} object per line or row", bad_json="not valid JSON"
    )
    return [row for _, row in rows]


def run(args, overrides=()) -> int:
    if args.out is not None:
        if args.prompts is None:
            raise UserError("--out writes the results of --prompts; one --prompt streams to stdout")
        check_out(args.out, args.overwrite)
    start_distributed(args)
    from lm.infer.sampling import SamplingParams
    from lm.store.load import load_trained

    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
    )
    if args.prompt is not None and not args.prompt:
        raise UserError("--prompt is empty; give at least one character of text")
    if args.draft is None and args.draft_k is not None:
        raise UserError("--draft-k needs --draft (a draft model's workdir or export, or 'ngram')")
    if args.draft_k is not None and args.draft_k < 1:
        raise UserError(f"speculative decoding: k={args.draft_k}: expected an integer >= 1 (drafted tokens per step)")
    rows = read_prompts(args.prompts, args.chat) if args.prompts else None
    loaded = load_trained(args.workdir, args.params, args.tokenizer)
    generate = _Generate(args, loaded, sampling)
    # every process decodes every prompt (the model spans them all, and the same seed draws the
    # same tokens); process 0 alone shows and writes the results
    main = is_main()

    if rows is None:
        if not args.chat and main:
            sys.stdout.write(args.prompt)
        shown = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if main else (lambda piece: None)
        result = generate([args.prompt], stream=shown)[0]
        if main:
            print(
                f"\n[{result['finish_reason']}: {len(result['ids'])} tokens{getattr(generate, 'note', '')}]",
                file=sys.stderr,
            )
        return 0
    if not main:
        writing = open(os.devnull, "w", encoding="utf-8")
    else:  # --out: written beside and renamed at the end, so an interrupted run leaves it as it was
        writing = atomic_open(args.out) if args.out else contextlib.nullcontext(sys.stdout)
    with writing as out:
        for row, result in zip(rows, generate([r.get("messages") or r["prompt"] for r in rows])):
            out.write(
                json.dumps(
                    row
                    | {
                        "completion": result["text"],
                        "finish_reason": result["finish_reason"],
                        "tokens": result["ids"],
                        "logprobs": result["logprobs"],
                    }
                )
                + "\n"
            )
    if args.out and main:
        print(f"wrote {len(rows)} completions to {args.out}{getattr(generate, 'note', '')}", file=sys.stderr)
    return 0


class _Generate:
    """generate(prompts, stream=None) -> result dicts, through a Session on the config's mesh
    (with --draft, speculating); `note` sums up the drafts kept (for the closing line on stderr)."""

    def __init__(self, args, loaded, sampling):
        from lm.infer.session import Session, load_draft

        k = 0 if args.draft is None else DRAFT_K if args.draft_k is None else args.draft_k
        draft = None if args.draft in (None, "ngram") else load_draft(args.draft)
        self.args, self.sampling, self.speculating = args, sampling, bool(k)
        self.session = Session(
            loaded, quantize=args.quantize, slots=args.batch_size, kv_cache=args.kv_cache, speculate=k, draft=draft
        )

    def __call__(self, prompts: list, **kw) -> list[dict]:
        stop, session = tuple(self.args.stop), self.session
        if not self.args.chat:
            return session.complete(prompts, self.sampling, stop=stop, **kw)
        return session.chat(prompts, self.sampling, stop=stop, **kw)

    @property
    def note(self) -> str:
        if not self.speculating:
            return ""
        proposed, accepted, passes = (self.session.drafted[name] for name in ("proposed", "accepted", "passes"))
        return (
            f"; speculative: {accepted}/{proposed} drafts kept ({accepted / max(proposed, 1):.0%}), "
            f"{(accepted + passes) / max(passes, 1):.2f} tokens per target pass"
        )
