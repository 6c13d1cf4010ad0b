"""Exact-match accuracy of greedy answers to held-out conversations, with the chat template.

Each conversation's last turn is the reference answer (an assistant turn); the turns before it
are rendered as the prompt (`ChatTemplate.prompt`) and the model answers with the KV-cache
sampler, greedily, until the end-of-turn marker. Answers and references are compared after
trimming surrounding whitespace.
"""

from __future__ import annotations

import pathlib

from lm.data.chat import ChatTemplate
from lm.data.sft import parse_record
from lm.errors import UserError
from lm.eval.complete import completions


def read_conversations(path, limit: int = 0) -> list[list[dict]]:
    """The conversations of a JSONL file (chat or instruction lines) that end with an assistant turn."""
    out = []
    for n, line in enumerate(pathlib.Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = parse_record(line)
        except ValueError as e:
            raise UserError(f"{path}:{n}: {e}") from None
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            out.append(messages)
        if limit and len(out) >= limit:
            break
    if not out:
        raise UserError(f"{path}: no conversation ending with an assistant turn to score")
    return out


def exact_match(model, params, tokenizer, conversations: list, *, max_new_tokens: int, mesh=None, rules=(),
                batch_size: int = 64, keep: int = 5) -> dict:
    """{'exact_match', 'n', 'examples': the first `keep` (prompt, reference, answer)}."""
    template = ChatTemplate.for_tokenizer(tokenizer)
    prompts = [template.prompt(c[:-1]) for c in conversations]
    room = model.spec.max_seq_len - max(len(p) for p in prompts)
    if room < 1:
        raise UserError("exact match: a held-out prompt fills the model's whole context")
    done = completions(model, params, tokenizer, prompts, max_new_tokens=min(max_new_tokens, room),
                       stop=template.stop_strings, eos_ids=template.stop_ids, mesh=mesh, rules=rules,
                       batch_size=batch_size)
    answers = [r["text"] for r in done]
    right = [a.strip() == c[-1]["content"].strip() for a, c in zip(answers, conversations)]
    examples = [(c[-2]["content"], c[-1]["content"], a) for c, a in zip(conversations[:keep], answers)]
    return {"exact_match": sum(right) / len(right), "n": len(right), "examples": examples}
