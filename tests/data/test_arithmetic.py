"""The tool-use task (lm.data.arithmetic): exact answers, disjoint splits, and tool conversations
that render with our chat template and whose call parses back as written."""

import json

import numpy as np
import pytest

from lm.data import arithmetic
from lm.data.chat import ChatTemplate, content_text
from lm.data.tokenizer import ByteTokenizer
from lm.errors import UserError
from lm.infer.serve.tools import ToolSyntax, parse


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("a, b, want", [(347, 29, "10063"), (100, 10, "1000"), (999, 99, "98901"), (125, 80, "10000")])
def test_questions_and_answers(a, b, want):
    assert arithmetic.question(a, b) == f"What is {a} * {b}?"
    assert arithmetic.expression(a, b) == f"{a} * {b}"
    assert arithmetic.answer(a, b) == want


def test_the_task_files(tmp_path):
    paths = arithmetic.write_arithmetic_task(tmp_path, n_tool=30, n_direct=20, n_prompts=25, n_heldout=40)
    sft, heldout, prompts = read(paths["sft"]), read(paths["heldout"]), read(paths["prompts"])
    assert (len(sft), len(heldout), len(prompts), len(read(paths["sft_heldout"]))) == (50, 40, 25, 40)
    tool = [r["messages"] for r in sft if r["messages"][0]["role"] == "system"]
    direct = [r["messages"] for r in sft if r["messages"][0]["role"] == "user"]
    assert (len(tool), len(direct)) == (30, 20)

    def pair(text):  # "What is A * B?" -> (A, B)
        a, b = text.removeprefix("What is ").removesuffix("?").split(" * ")
        return int(a), int(b)

    for m in direct:
        a, b = pair(m[0]["content"])
        assert m[1] == {"role": "assistant", "content": str(a * b)}
    for m in tool:
        a, b = pair(m[1]["content"])
        assert [t["role"] for t in m] == ["system", "user", "assistant", "tool", "assistant"]
        assert json.loads(m[2]["tool_calls"][0]["function"]["arguments"]) == {"x": f"{a} * {b}"}
        assert m[3]["content"] == m[4]["content"] == str(a * b)
    train = {pair(m[-2 if m[0]["role"] == "user" else 1]["content"]) for m in direct + tool}
    train |= {pair(r["prompt"]) for r in prompts}
    held = {pair(r["prompt"]) for r in heldout}
    assert len(train) == 75 and len(held) == 40 and not train & held  # distinct, and disjoint
    assert all(arithmetic.is_heldout(*p) for p in held) and not any(arithmetic.is_heldout(*p) for p in train)
    for a, b in train | held:
        assert 100 <= a <= 999 and 10 <= b <= 99
    for r in prompts + heldout:
        assert r["answer"] == str(np.prod(pair(r["prompt"])))
    again = arithmetic.write_arithmetic_task(tmp_path / "again", n_tool=30, n_direct=20, n_prompts=25, n_heldout=40)
    assert all(paths[k].read_text() == again[k].read_text() for k in paths)  # seeded


def test_a_task_of_nothing_is_refused(tmp_path):
    with pytest.raises(UserError, match="must be >= 1"):
        arithmetic.write_arithmetic_task(tmp_path, n_heldout=0)


def test_a_tool_conversation_renders_and_its_call_parses_back():
    template = ChatTemplate.for_tokenizer(ByteTokenizer())
    messages = arithmetic.tool_conversation(347, 29)
    ids, weights = template.render(messages)
    text = ByteTokenizer().decode(ids)
    listed = json.dumps(arithmetic.TOOL)
    assert f"{listed}\n" in text and "What is 347 * 29?" in text
    # what is trained on: the call and the answer (with their end markers), not the tool's result
    trained = ByteTokenizer().decode(ids[weights > 0])
    call = '<tool_call>\n{"name": "calc", "arguments": {"x": "347 * 29"}}\n</tool_call>'
    end = "<|end|>"
    assert trained == f"{call}{end}10063{end}"
    # the prompt an environment renders (the user's question, the tool listed) starts the conversation
    prompt = template.prompt(messages[1:2], tools=[arithmetic.TOOL])
    np.testing.assert_array_equal(prompt, ids[: len(prompt)])
    family = ToolSyntax.of(ChatTemplate.source, {}).family
    content, calls = parse(family, content_text(messages[2]), {"calc"})
    assert content.strip() == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"x": "347 * 29"})
    ]
