"""Exact-match accuracy of greedy answers to held-out conversations, with the chat template.

Each conversation's last turn is the reference answer (an assistant turn); the turns before it
are rendered as the prompt (`lm.data.chat.prompt_ids`) and the model answers with the KV-cache
sampler, greedily, until the end-of-turn marker. Answers and references are compared after
trimming surrounding whitespace.
"""

from __future__ import annotations

import jax

from lm.config import rules_table
from lm.data.chat import ChatTemplate, prompt_ids
from lm.data.jsonl import ONE_OBJECT, iter_jsonl
from lm.data.sft import parse_record
from lm.errors import UserError
from lm.eval.complete import completions
from lm.infer.generate import generation_context
from lm.model.build import build_model
from lm.model.lora import merge_lora
from lm.model.spec import ModelSpec


def read_conversations(path, limit: int = 0) -> list[list[dict]]:
    """The conversations of a JSONL file (chat or instruction lines) that end with an assistant turn."""
    out = []
    for _, messages in iter_jsonl(path, parse_record, expected=ONE_OBJECT):
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            out.append(messages)
        if limit and len(out) >= limit:
            break
    if not out:
        raise UserError(f"{path}: no conversation ending with an assistant turn to score")
    return out


def exact_match(
    model,
    params,
    tokenizer,
    conversations: list,
    *,
    max_new_tokens: int,
    mesh=None,
    rules=(),
    batch_size: int = 64,
    keep: int = 5,
) -> dict:
    """{'exact_match', 'n', 'examples': the first `keep` (prompt, reference, answer)}."""
    template = ChatTemplate.for_tokenizer(tokenizer)
    prompts = [prompt_ids(template, c[:-1]) for c in conversations]
    room = generation_context(model.spec) - max(len(p) for p in prompts)
    if room < 1:
        raise UserError("exact match: a held-out prompt fills the model's whole context")
    done = completions(
        model,
        params,
        tokenizer,
        prompts,
        max_new_tokens=min(max_new_tokens, room),
        stop=template.stop_strings,
        eos_ids=template.stop_ids,
        mesh=mesh,
        rules=rules,
        batch_size=batch_size,
    )
    answers = [r["text"] for r in done]
    right = [a.strip() == c[-1]["content"].strip() for a, c in zip(answers, conversations)]
    examples = [(c[-2]["content"], c[-1]["content"], a) for c, a in zip(conversations[:keep], answers)]
    return {"exact_match": sum(right) / len(right), "n": len(right), "examples": examples}


def plain_model(config, params):
    """(the model of `config` without adapters on its mesh, params with any adapters folded in)."""
    m = config.model
    built = build_model(config, rules=rules_table(config), spec=ModelSpec.from_config(m).without_lora())
    if m.lora_rank == 0:
        return built, built.place(params)
    # host or lazy leaves, shard by shard
    params = build_model(config, rules=built.rules, mesh=built.mesh).place(params)
    merged = jax.jit(lambda p: merge_lora(p, m.lora_alpha, m.lora_rank), out_shardings=built.param_shardings)(params)
    return built, merged


def answer_accuracy(config, params, tokenizer, conversations, max_new_tokens: int) -> dict:
    """Exact match of greedy answers of a model (adapters folded in) on its config's mesh."""
    built, params = plain_model(config, params)
    return exact_match(
        built.module,
        params,
        tokenizer,
        conversations,
        max_new_tokens=max_new_tokens,
        mesh=built.mesh,
        rules=built.rules,
    )


def compare_answers(loaded, config, params, path, examples: int, max_new_tokens: int) -> dict:
    """Exact match of the init model (`loaded`) and the tuned one on held-out conversations,
    printed; the summary fields (exact_match_init, exact_match, exact_match_n, answers)."""
    conversations = read_conversations(path, examples)
    before = answer_accuracy(loaded.config, loaded.params, loaded.tokenizer, conversations, max_new_tokens)
    after = answer_accuracy(config, params, loaded.tokenizer, conversations, max_new_tokens)
    print(
        f"exact match of greedy answers on {after['n']} held-out prompts: init {before['exact_match']:.1%}"
        f" -> tuned {after['exact_match']:.1%}"
    )
    return {
        "exact_match_init": before["exact_match"],
        "exact_match": after["exact_match"],
        "exact_match_n": after["n"],
        "answers": after["examples"],
    }
