"""Structured output: OpenAI's response_format as a JSON schema, bad schemas refused with their reason,
the bitmask of the tokens a grammar allows, and the engine's rows under a grammar always giving
JSON that parses and validates while the other rows of the batch decode as without it."""

import json

import numpy as np
import pytest

from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.grammar import grammar_of, schema_of, vocabulary
from lm.infer.sampling import SamplingParams
from tests.infer.test_generate import model_params

TOK = ByteTokenizer()
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def constraint(schema=SCHEMA):
    return vocabulary(TOK, 264, (TOK.eos_id,)).constraint(grammar_of(schema))


def allowed(mask: np.ndarray) -> list[int]:
    ids = np.arange(32 * len(mask))
    return ids[((mask[ids // 32] >> (ids % 32)) & 1) != 0].tolist()


def test_response_formats_and_their_refusals():
    assert schema_of({"type": "text"}) is None
    assert schema_of({"type": "json_object"}) == {"type": "object"}
    assert schema_of({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) == SCHEMA
    with pytest.raises(UserError, match="'response_format.type' is 'xml'"):
        schema_of({"type": "xml"})
    with pytest.raises(UserError, match="must be an object with a 'schema' object"):
        schema_of({"type": "json_schema", "json_schema": {"schema": [1]}})
    with pytest.raises(UserError, match="'response_format' schema: .*nonsense"):
        grammar_of({"type": "nonsense"})


def test_the_mask_follows_the_grammar():
    c = constraint()
    assert allowed(c.mask()) == [ord("{")]  # compact JSON: the object opens at once
    for ch in '{"ok":tr':
        c.advance(ord(ch))
    assert allowed(c.mask()) == [ord("u")]
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        c.advance(ord("x"))


def run(requests):
    model, params = model_params()
    engine = Engine(model, max_len=40, config=EngineConfig(slots=4, page_size=4, chunk=8, decode_block=4))
    return engine.run(params, requests)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_under_a_grammar_give_valid_json_beside_free_rows(temperature):
    sampling = SamplingParams(max_new_tokens=32, temperature=temperature, seed=3)
    free = [[5, 9, 13, 2], [100, 3]]
    want = run([Request(p, sampling, eos=(TOK.eos_id,)) for p in free])
    got = run(
        [Request(p, sampling, eos=(TOK.eos_id,)) for p in free]
        + [Request([7, 8], sampling, eos=(TOK.eos_id,), constraint=constraint()) for _ in range(2)]
    )
    for g, w in zip(got, want):  # the other rows' tokens do not change
        assert g.ids == w.ids
    for r in got[2:]:
        assert r.finish == "eos" and r.ids[-1] == TOK.eos_id
        answer = json.loads(bytes(r.ids[:-1]))
        assert set(answer) == {"ok", "color"} and isinstance(answer["ok"], bool)
        assert answer["color"] in ("red", "green", "blue")
        assert all(np.isfinite(r.logps))  # the model's log-probs, not the masked ones
