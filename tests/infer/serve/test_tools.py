"""Tools in `lm serve` (lm.infer.serve.tools): the three call syntaxes parsed from hand-written
answers, whole and streamed; the tools fields checked; tools, calls and results rendered by each
family's template exactly as transformers renders them; forced calls' grammars walked on real
tokenizers; and the openai client against a tiny random model with Qwen 2.5's template: a forced
call whose arguments validate, its result sent back, and a streamed call."""

import json
import re

import jax
import jsonschema
import numpy as np
import openai
import pytest

from lm.config import base_config
from lm.data.chat import ChatTemplate
from lm.data.hf_tokenizer import HFTokenizer
from lm.infer.engine.engine import EngineConfig
from lm.infer.grammar import vocabulary
from lm.infer.serve.app import make_app
from lm.infer.serve.engine_backend import EngineBackend, Keeping
from lm.infer.serve.protocol import RequestError, parse_request
from lm.infer.serve.server import InThread
from lm.infer.serve.tools import FAMILIES, Answer, ToolError, ToolSyntax, forced_grammar, plan, read_tools
from lm.infer.session import Session
from lm.model.spec import ModelSpec
from lm.model.transformer import Transformer
from lm.store.loaded import Loaded
from tests.hf_tokenizers import QWEN_TEMPLATE, gemma_like, llama3_like, qwen_like
from tests.infer.serve.tool_templates import LLAMA31_TOOLS, MISTRAL_SPECIALS, MISTRAL_TOOLS, QWEN25_TOOLS, with_template
from tests.model.test_transformer import random_params

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
FAMILY = {f.name: f for f in FAMILIES}
NAMES = {"get_weather", "now"}
PARIS = ("get_weather", {"city": "Paris"})
NOW = ("now", {})
USER = [{"role": "user", "content": "Weather in Paris?"}]


# ---- answers -----------------------------------------------------------------------------------

PARIS_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER_BLOCK = f"<tool_call>\n{PARIS_JSON}\n</tool_call>"
NOW_BLOCK = '\n<tool_call>\n{"name": "now"}\n</tool_call>'
LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "family, text, content, calls",
    [
        ("hermes", WEATHER_BLOCK, None, [PARIS]),
        ("hermes", "Let me look.\n" + WEATHER_BLOCK + NOW_BLOCK, "Let me look.", [PARIS, NOW]),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', ..., None),
        ("hermes", '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>', ..., None),  # unknown
        ("hermes", "It is sunny, <tool_call> aside.", ..., None),
        ("mistral", f"[TOOL_CALLS] [{PARIS_JSON}]", None, [PARIS]),
        ("mistral", f'[TOOL_CALLS][{PARIS_JSON}, {{"name": "now", "arguments": {{}}}}]', None, [PARIS, NOW]),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}', ..., None),  # cut
        ("mistral", '[{"name": "get_weather", "arguments": {}}]', ..., None),  # JSON, not a call
        ("mistral", "Sunny.", ..., None),
        ("llama", LLAMA_PARIS, None, [PARIS]),
        ("llama", f'<|python_tag|>{LLAMA_PARIS}; {{"name": "now", "parameters": {{}}}}', None, [PARIS, NOW]),
        ("llama", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),  # as text
        ("llama", '{"name": "get_weather", "parameters": [1]}', ..., None),
        ("llama", 'Here: {"name": "get_weather", "parameters": {}}', ..., None),  # calls are the whole answer
        ("llama", LLAMA_PARIS + " and more", ..., None),
        ("llama", "Sunny.", ..., None),
    ],
)  # fmt: skip
def test_answers_parse_into_calls_or_stay_content_whole_or_streamed(family, text, content, calls):
    got, found = Answer(FAMILY[family], NAMES).whole(text)
    if calls is None:
        assert found is None and got == text
    else:
        assert (
            got == content and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found] == calls
        )
        ids = {c["id"] for c in found}
        pattern = r"[A-Za-z0-9]{9}" if family == "mistral" else r"call_[0-9a-f]{24}"
        assert len(ids) == len(found) and all(re.fullmatch(pattern, i) for i in ids)
        assert {c["type"] for c in found} == {"function"}
    answer = Answer(FAMILY[family], NAMES)
    shown = "".join(answer.add(ch) for ch in text)  # one character at a time
    rest, streamed = answer.end()
    assert (streamed is None) == (calls is None)
    assert (shown + rest if calls is None else (shown + rest).strip() or None) == (text if calls is None else content)


def test_content_streams_until_a_call_may_begin():
    answer = Answer(FAMILY["hermes"], NAMES)
    assert answer.add("Let me look.\n<tool") == "Let me look.\n"  # "<tool" may begin a call: held back
    assert answer.add("_call>\n") == "" and answer.add('{"name": "now"}\n</tool_call>') == ""
    assert answer.end()[1][0]["function"] == {"name": "now", "arguments": "{}"}
    plain = Answer(FAMILY["llama"], NAMES)
    assert plain.add(" ") == "" and plain.add("Sun") == " Sun" and plain.add("ny {") == "ny {"
    assert plain.end() == ("", None)


# ---- the request's fields ----------------------------------------------------------------------


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, "tools": TOOLS} | fields).encode()


def weather_call(arguments='{"city": "Paris"}') -> dict:
    return {"id": "abcdefgh1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def one(function: dict) -> list[dict]:
    return [{"type": "function", "function": function}]


def called(arguments: str) -> list[dict]:
    return USER + [{"role": "assistant", "tool_calls": [weather_call(arguments)]}]


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": {"type": "function"}}, "tools", "expected an array of"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] is"),
        ({"tools": one({"name": "get weather"})}, "tools", "tools[0].function.name"),
        ({"tools": one({"name": "f", "parameters": []})}, "tools", "expected a JSON schema"),
        ({"tools": one({"name": "f", "params": {}})}, "tools", "unknown field 'params'"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "'get_weather' is defined twice"),
        ({"tool_choice": {"type": "function", "function": {"name": "send"}}}, "tool_choice", 'names function "send"'),
        ({"tool_choice": "always"}, "tool_choice", "expected 'none', 'auto', 'required'"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "has no 'tools'"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "expected a boolean"),
        ({"messages": called("{city")}, "messages", "not valid JSON"),
        ({"messages": called('"x"')}, "messages", "a JSON object"),
        ({"messages": USER + [{"role": "tool", "content": "22 C"}]}, "messages", "needs 'tool_call_id'"),
    ],
)  # fmt: skip
def test_bad_tools_fields_are_one_line_errors_naming_the_field(fields, param, words):
    with pytest.raises(RequestError) as e:
        parse_request(body(**fields), "chat")
    assert e.value.param == param and words in e.value.message and "\n" not in e.value.message


def test_the_plan_refuses_what_the_template_cannot_do():
    tools = read_tools({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(ToolError, match="chat template defines no tools") as e:
        plan(tools, ToolSyntax.of(None, {}))  # our own template: no tools
    assert e.value.param == "tools"
    for unknown in ("{{ tools | tojson }}{{ messages }}", "{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}"):
        with pytest.raises(ToolError, match="does not read") as e:
            plan(tools, ToolSyntax.of(unknown, {}))  # tools, but no syntax this server reads (Mistral v11's)
        assert e.value.param == "tool_choice"
    with pytest.raises(ToolError, match="give one") as e:
        plan(tools, ToolSyntax.of(QWEN25_TOOLS, {}), schema={"type": "object"})
    none = plan(read_tools({"tools": TOOLS, "tool_choice": "none"}), ToolSyntax.of(QWEN25_TOOLS, {}))
    assert none.answer() is None and none.grammar is None and none.tools == TOOLS
    bad = one({"name": "f", "parameters": {"type": "nonsense"}})
    with pytest.raises(ToolError, match="'tools' parameters: .*nonsense") as e:
        plan(read_tools({"tools": bad, "tool_choice": "required"}), ToolSyntax.of(QWEN25_TOOLS, {}))


# ---- templates and grammars of real tokenizers -------------------------------------------------


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tools")
    return {
        "hermes": with_template(qwen_like(root / "qwen"), QWEN25_TOOLS),
        "llama": with_template(llama3_like(root / "llama"), LLAMA31_TOOLS),
        "mistral": with_template(gemma_like(root / "mistral"), MISTRAL_TOOLS, tuple(MISTRAL_SPECIALS)),
    }


ROUND_TRIP = USER + [
    {"role": "assistant", "content": "", "tool_calls": [weather_call({"city": "Paris"})]},
    {"role": "tool", "content": "22 C, sunny", "tool_call_id": "abcdefgh1"},
]


@pytest.mark.parametrize("family", ["hermes", "llama", "mistral"])
def test_tools_calls_and_results_render_as_transformers_renders_them(family_dirs, family):
    from transformers import AutoTokenizer

    tok = HFTokenizer(family_dirs[family])
    template = ChatTemplate.for_tokenizer(tok)
    syntax = ToolSyntax.of(template.source, tok.special_tokens())
    assert syntax.family is FAMILY[family] and (family == "mistral") == ("[TOOL_CALLS]" in syntax.specials)
    hf = AutoTokenizer.from_pretrained(family_dirs[family])
    for messages in (USER, ROUND_TRIP):
        want = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        assert list(template.prompt(messages, TOOLS)) == list(want["input_ids"])
    assert "get_weather" in tok.decode(template.prompt(USER, TOOLS))  # the tools are in the prompt
    assert not ToolSyntax.of(QWEN_TEMPLATE, {}).renders  # a template that never reads tools


@pytest.mark.parametrize("family, choice", [("hermes", "required"), ("llama", "function"), ("mistral", "required")])
def test_every_answer_a_forced_grammar_allows_is_a_valid_call(family_dirs, family, choice):
    """Random walks through the tokens the grammar allows: each ends in a whole call of a listed
    function whose arguments validate (Mistral's [TOOL_CALLS] is a special token, kept as text)."""
    tok = HFTokenizer(family_dirs[family])
    syntax = ToolSyntax.of(ChatTemplate.for_tokenizer(tok).source, tok.special_tokens())
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = read_tools({"tools": TOOLS, "tool_choice": named if choice == "function" else choice})
    grammar, ends = forced_grammar(syntax.family, request, syntax.specials), tuple(tok.stop_ids)
    words, rng = vocabulary(tok, tok.vocab_size, ends), np.random.default_rng(0)
    for _ in range(3):
        constraint, ids = words.constraint(grammar), []
        while len(ids) < 400:
            bits = (constraint.mask()[:, None] >> np.arange(32)) & 1
            token = int(rng.choice(np.flatnonzero(bits.reshape(-1))))
            if token in ends:
                break
            constraint.advance(token)
            ids.append(token)
        content, calls = Answer(syntax.family, NAMES).whole(Keeping(tok, syntax.keep).decode(ids))
        assert content is None and calls and (choice == "required" or len(calls) == 1)
        for call in calls:
            schema = {"get_weather": WEATHER, "now": {"type": "object", "maxProperties": 0}}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


# ---- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(family_dirs):
    c = base_config()
    c.model.update(
        vocab_size=1536, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=1024, init_std=0.3
    )
    params = jax.tree.map(np.asarray, random_params(Transformer(ModelSpec.from_config(c.model)), seed=1))
    loaded = Loaded(c, params, HFTokenizer(family_dirs["hermes"]), "tiny random model, Qwen 2.5's template")
    backend = EngineBackend(Session(loaded), "tiny", config=EngineConfig(slots=2, page_size=16))
    yield backend
    backend.shutdown(cancel=True)


@pytest.fixture(scope="module")
def client(backend):
    with InThread(make_app(backend)) as running:
        # generous: a loaded machine is slow, and the first requests compile
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_a_forced_call_validates_and_its_result_goes_back(client, backend):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice=named, max_tokens=120, temperature=1.0, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    result = {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}
    messages = USER + [choice.message.model_dump(exclude_none=True), result]
    again = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens
    sent = parse_request(json.dumps({"model": "tiny", "messages": messages, "tools": TOOLS}).encode(), "chat")
    prompt = backend.tokenizer.decode(backend.prompt_ids(messages=sent.messages, tools=TOOLS)[0])
    assert (
        '"name": "get_weather", "arguments": ' + json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
        in prompt
    )
    assert prompt.endswith("<tool_response>\n22 C, sunny\n</tool_response>\nassistant\n")  # specials dropped


def test_a_streamed_call_comes_whole_in_one_delta(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=5,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1 and [(t.index, t.type) for t in calls[0]] == [(0, "function")]
    assert not "".join(d.content or "" for d in deltas).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = calls[0][0].function
    schema = {"get_weather": WEATHER, "now": {"type": "object", "maxProperties": 0}}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)


def test_a_bad_tool_choice_is_a_400_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "send"}}
        )
    assert e.value.body["param"] == "tool_choice" and 'names function "send"' in e.value.body["message"]
