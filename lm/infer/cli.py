"""`lm sample`: completions from a trained run or an export, one prompt (streamed) or a JSONL file."""

from __future__ import annotations

import json
import os
import pathlib
import sys

from lm.data.jsonl import read_jsonl
from lm.errors import UserError
from lm.verb import add_distributed, is_main, start_distributed

BATCH = 16  # prompts decoded together from a --prompts file


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate text with the KV cache from a run or an export",
                       description="Generate from `lm train`'s newest checkpoint (--workdir) or an `lm export` "
                                   "(--params). One --prompt streams its completion to stdout; --prompts reads "
                                   'JSONL lines {"prompt": TEXT, ...} and writes each line back with its completion.')
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="an `lm train` workdir (its newest checkpoint)")
    src.add_argument("--params", help="an `lm export` output: a directory or a .safetensors file")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; the completion streams as it is generated")
    what.add_argument("--prompts", help="a JSONL file of {\"prompt\": ...} objects")
    p.add_argument("--out", help="with --prompts: where to write the JSONL results (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    p.add_argument("--tokenizer", help="a sentencepiece .model (default: the one the run was trained with)")
    p.add_argument("--batch-size", type=int, default=BATCH, help="prompts decoded together")
    p.add_argument("--chat", action="store_true",
                   help="answer as the assistant with the chat template: --prompt is a user turn; --prompts lines "
                        "may hold {\"messages\": [...]} (ending with a user turn) instead of a prompt")
    add_distributed(p)


def read_prompts(path: str, chat: bool = False) -> list[dict]:
    file = pathlib.Path(path)
    if not file.is_file():
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
    rows = read_jsonl(path, prompt_row, what="prompts", expected=f"one {line} object per line",
                      bad_json="not valid JSON")
    return [row for _, row in rows]


def run(args, overrides=()) -> int:
    start_distributed(args)
    from lm.infer.sampling import SamplingParams
    from lm.infer.session import Session
    from lm.store.load import load_trained

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    if args.prompt is not None and not args.prompt:
        raise UserError("--prompt is empty; give at least one character of text")
    rows = read_prompts(args.prompts, args.chat) if args.prompts else None
    session = Session(load_trained(args.workdir, args.params, args.tokenizer))
    stop = tuple(args.stop)
    # every process decodes every prompt (the model spans them all, and the same seed draws the
    # same tokens); process 0 alone shows and writes the results
    main = is_main()

    def generate(prompts: list, **kw):
        if not args.chat:
            return session.complete(prompts, sampling, stop=stop, **kw)
        turns = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
        return session.chat(turns, sampling, stop=stop, **kw)

    if rows is None:
        if not args.chat and main:
            sys.stdout.write(args.prompt)
        shown = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if main else (lambda piece: None)
        result = generate([args.prompt], stream=shown)[0]
        if main:
            print(f"\n[{result['finish_reason']}: {len(result['ids'])} tokens]", file=sys.stderr)
        return 0
    if not main:
        out = open(os.devnull, "w", encoding="utf-8")
    else:
        out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for start in range(0, len(rows), args.batch_size):
            batch = rows[start: start + args.batch_size]
            for row, result in zip(batch, generate([r.get("messages") or r["prompt"] for r in batch])):
                out.write(json.dumps(row | {"completion": result["text"], "finish_reason": result["finish_reason"],
                                            "tokens": result["ids"], "logprobs": result["logprobs"]}) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out and main:
        print(f"wrote {len(rows)} completions to {args.out}", file=sys.stderr)
    return 0
