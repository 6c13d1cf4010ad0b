"""Structured output: a JSON schema (or "any JSON object") turned into the tokens allowed next.

llguidance (Microsoft's guidance engine: a Rust core with no Python dependencies, the structured
output backend of vLLM, SGLang and llama.cpp) compiles the schema to a grammar and, for each
step, gives a bitmask over the vocabulary (one bit per token id, 32 ids to an int32 word); the
engine's sampling step sets every token outside it to -inf before choosing (lm.infer.engine.rows).
It reads the vocabulary from the tokenizer's Hugging Face tokenizer.json (ours are built by
lm.store.hf.tokenizer). JSON is compact (no whitespace between tokens), so a model cannot spend
its budget on blank space; an answer ends when the grammar is complete and the model then
chooses an end id (the only tokens allowed), or at max_tokens (cut, as OpenAI's).
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np

from lm.errors import UserError

COMPACT = {"whitespace_flexible": False}
# the spacing of json.dumps' defaults, which chat templates' tojson writes: tool-call arguments as
# a model saw them in training
SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_of(response_format: dict) -> dict | None:
    """The JSON schema an OpenAI `response_format` asks for (None: plain text). Bad input: UserError."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise UserError("'response_format.json_schema' must be an object with a 'schema' object")
        return schema
    raise UserError(f"'response_format.type' is {kind!r}; expected 'text', 'json_object' or 'json_schema'")


def grammar_of(schema: dict) -> str:
    """The llguidance grammar of a JSON schema; a schema it cannot take: UserError with its reason."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
    except ValueError as e:
        raise UserError(f"'response_format' schema: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise UserError(f"'response_format' schema: {error}")
    return grammar


def json_lark(schema: dict) -> str:
    """A JSON schema as a piece of a lark grammar (lark_grammar's), written with SPACED's spacing."""
    given = schema.get("x-guidance")
    return "%json " + json.dumps({**schema, "x-guidance": {**(given if isinstance(given, dict) else {}), **SPACED}})


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a lark text (pieces from json_lark allowed); one it cannot take:
    UserError with its reason."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise UserError(_reason(str(e))) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise UserError(_reason(error))
    return grammar


def _reason(error: str) -> str:
    """llguidance's first line, without the position in the lark text (the caller's, not the user's)."""
    return re.sub(r"^at \d+\(\d+\): ", "", error.strip().splitlines()[0])


class Vocabulary:
    """One tokenizer as llguidance sees it (built once per tokenizer and end ids: it indexes the
    whole vocabulary). vocab_size: the model's (its logits' width, at least the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, end_ids: tuple[int, ...]):
        import llguidance

        from lm.store.hf.tokenizer import tokenizer_json

        self.words = -(-vocab_size // 32)
        self.llg = llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=list(end_ids))

    def constraint(self, grammar: str) -> "Constraint":
        import llguidance

        return Constraint(llguidance.LLMatcher(self.llg, grammar), self.words)


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer, vocab_size: int, end_ids: tuple[int, ...]) -> Vocabulary:
    return Vocabulary(tokenizer, vocab_size, end_ids)


class Constraint:
    """One request's grammar as it advances: `mask()` the tokens allowed next (int32 words, bit
    t % 32 of word t // 32), `advance(token)` after each chosen token."""

    def __init__(self, matcher, words: int):
        self.matcher, self.words = matcher, words

    def mask(self) -> np.ndarray:
        out = np.zeros(self.words, np.int32)
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {token} breaks the grammar ({self.matcher.get_error()})")
