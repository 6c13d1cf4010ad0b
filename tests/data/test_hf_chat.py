"""A model's own chat template (HFChatTemplate) against transformers' apply_chat_template: text,
ids, assistant masks ({% generation %} blocks), BPE merges across a turn boundary, templates that
are not prefix-consistent, stops, and errors. Tokenizer directories come from tests/hf_tokenizers.py."""

import json
import shutil

import numpy as np
import pytest

from lm.data.chat import ChatTemplate
from lm.data.hf_chat import HFChatTemplate
from lm.data.tokenizer import ByteTokenizer, load_tokenizer
from lm.errors import UserError
from tests.hf_tokenizers import LLAMA3_GENERATION_TEMPLATE

pytest.importorskip("transformers")
NAMES = ["llama3_tokenizer", "qwen_tokenizer", "gemma_tokenizer"]
CONVO = [
    {"role": "system", "content": "Be brief. Answer in Python."},
    {"role": "user", "content": "How do I add two numbers?"},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    {"role": "user", "content": "And caf\u00e9 \U0001f642?"},
    {"role": "assistant", "content": " print('caf\u00e9')"},
]
PLAIN = """{%- for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}
{{- message['role'] + ': ' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}
{%- endgeneration %}{% else %}{{ message['content'] }}{% endif %}{% endfor %}
{%- if add_generation_prompt %}{{ '\\nassistant: ' }}{% endif %}"""
DROPS_THINKING = LLAMA3_GENERATION_TEMPLATE.replace(
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}",
    "{%- set content = message['content'] if loop.last else message['content'].split('</think>')[-1] %}"
    "{%- generation %}{{- content | trim + '<|eot_id|>' }}{%- endgeneration %}",
)

SHOWS_LAST_THINKING = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
            {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.fixture(params=NAMES)
def directory(request):
    return request.getfixturevalue(request.param)


def auto(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def with_template(source_dir, tmp_path, template: str):
    """A copy of a tokenizer directory with another chat_template.jinja."""
    out = tmp_path / "tok"
    shutil.copytree(source_dir, out)
    (out / "chat_template.jinja").write_text(template)
    return out


def template_of(directory):
    return ChatTemplate.for_tokenizer(load_tokenizer(str(directory)))


def test_the_one_choice_point(llama3_tokenizer, tmp_path):
    assert isinstance(template_of(llama3_tokenizer), HFChatTemplate)
    bare = tmp_path / "bare"
    shutil.copytree(llama3_tokenizer, bare)
    (bare / "chat_template.jinja").unlink()
    assert type(template_of(bare)) is ChatTemplate  # no template of its own: ours, markers as text
    assert type(ChatTemplate.for_tokenizer(ByteTokenizer())) is ChatTemplate


@pytest.mark.parametrize("messages", [CONVO, CONVO[1:], CONVO[:3]])
def test_text_and_ids_equal_transformers(directory, messages):
    hf, template = auto(directory), template_of(directory)
    for prompt in (False, True):
        convo = messages[:-1] if prompt else messages
        assert template._text(convo, prompt) == hf.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=prompt
        )
        want = hf.apply_chat_template(convo, add_generation_prompt=prompt, return_dict=False)
        got = template.prompt(convo) if prompt else template.render(convo)[0]
        assert got.dtype == np.int32 and got.tolist() == want


def test_template_list_in_tokenizer_config(qwen_tokenizer, tmp_path):
    out = tmp_path / "listed"
    shutil.copytree(qwen_tokenizer, out)
    source = (out / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ raise_exception('no') }}"},
        {"name": "default", "template": source},
    ]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert template_of(out).prompt(CONVO[:4]).tolist() == auto(out).apply_chat_template(
        CONVO[:4], add_generation_prompt=True, return_dict=False
    )


def test_masks_equal_transformers_generation_blocks(llama3_tokenizer, tmp_path):
    marked = with_template(llama3_tokenizer, tmp_path, LLAMA3_GENERATION_TEMPLATE)
    want = auto(marked).apply_chat_template(CONVO, return_assistant_tokens_mask=True, return_dict=True)
    for directory in (llama3_tokenizer, marked):  # spans found by prefixes agree with the blocks
        ids, weights = template_of(directory).render(CONVO)
        assert ids.tolist() == want["input_ids"]
        assert weights.dtype == np.float32 and weights.tolist() == want["assistant_masks"]
    tok = load_tokenizer(str(llama3_tokenizer))
    ids, weights = template_of(llama3_tokenizer).render(CONVO)
    eot = tok.special_id("<|eot_id|>")
    assert tok.decode(ids[weights > 0]) == "def add(a, b):\n    return a + bprint('caf\u00e9')"  # trimmed
    assert (ids[weights > 0] == eot).sum() == 2  # each turn's end is learnt


@pytest.mark.parametrize("name", NAMES)
def test_each_turn_ends_with_its_end_of_turn_token(request, name):
    directory = request.getfixturevalue(name)
    template, tok = template_of(directory), load_tokenizer(str(directory))
    end = {"llama3_tokenizer": "<|eot_id|>", "qwen_tokenizer": "<|im_end|>", "gemma_tokenizer": "<end_of_turn>"}[name]
    assert tok.special_id(end) in template.stop_ids and tok.eos_id in template.stop_ids
    ids, weights = template.render(CONVO)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))  # starts and ends of trained runs
    assert len(runs) == 4 and all(ids[e - 1] == tok.special_id(end) for e in runs[1::2])
    _, last = template.render(CONVO, train_on="last")
    assert last.sum() < weights.sum() and (last <= weights).all() and last[: runs[2]].sum() == 0


def test_a_merge_across_the_turn_boundary_is_weighted_once(llama3_tokenizer, tmp_path):
    """ " def" and "):\\n" are single tokens of this BPE: the first carries the space before the
    content, the second the newline after it."""
    directory = with_template(llama3_tokenizer, tmp_path, PLAIN)
    messages = [
        {"role": "user", "content": "Write f."},
        {"role": "assistant", "content": "def f(x):"},
        {"role": "user", "content": "More."},
        {"role": "assistant", "content": "return x"},
    ]
    template, tok = template_of(directory), load_tokenizer(str(directory))
    text = template._text(messages)
    spans = [(text.index(c), text.index(c) + len(c)) for c in ("def f(x):", "return x")]
    ids, offsets = tok.encode_offsets(text)
    inside = [any(s < b and e > a for a, b in spans) for s, e in offsets]
    straddling = [any(s < a < e or s < b < e for a, b in spans) for s, e in offsets]
    crossing = {text[s:e] for (s, e), x in zip(offsets, straddling) if x}
    assert {" def", "):\n"} <= crossing
    ids_got, weights = template.render(messages)
    assert ids_got.tolist() == ids.tolist() and weights.tolist() == [float(x) for x in inside]
    want = auto(directory).apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    assert weights.tolist() == want["assistant_masks"]


def test_a_template_that_is_not_prefix_consistent(llama3_tokenizer, tmp_path):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>hm</think>Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>ok</think>Bye"},
    ]
    marked = with_template(llama3_tokenizer, tmp_path / "a", DROPS_THINKING)
    want = auto(marked).apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    ids, weights = template_of(marked).render(messages)  # falls back to the {% generation %} blocks
    assert ids.tolist() == want["input_ids"] and weights.tolist() == want["assistant_masks"]
    unmarked = with_template(
        llama3_tokenizer,
        tmp_path / "b",
        DROPS_THINKING.replace("{%- generation %}", "").replace("{%- endgeneration %}", ""),
    )
    with pytest.raises(
        UserError,
        match=f"chat template '{unmarked / 'chat_template.jinja'}': cannot find the "
        "assistant's text: .*no {% generation %} blocks",
    ) as e:
        template_of(unmarked).render(messages)
    assert "\n" not in str(e.value)


def test_a_turn_that_renders_otherwise_when_last(qwen_tokenizer, tmp_path):
    """As Qwen3's template: an empty reasoning block only on the last assistant turn. Each prompt
    is still a prefix, and each turn is found after it."""
    marked = with_template(qwen_tokenizer, tmp_path / "a", SHOWS_LAST_THINKING)
    unmarked = with_template(
        qwen_tokenizer,
        tmp_path / "b",
        SHOWS_LAST_THINKING.replace("{%- generation %}", "").replace("{%- endgeneration %}", ""),
    )
    want = auto(marked).apply_chat_template(CONVO[1:], return_assistant_tokens_mask=True, return_dict=True)
    template = template_of(unmarked)
    assert "endgeneration" not in (unmarked / "chat_template.jinja").read_text()
    assert not template._text(CONVO[1:]).startswith(template._text(CONVO[1:3]))
    for directory in (marked, unmarked):
        ids, weights = template_of(directory).render(CONVO[1:])
        assert ids.tolist() == want["input_ids"] and weights.tolist() == want["assistant_masks"]


def test_prompt_stops_and_answer_text(qwen_tokenizer):
    template, tok = template_of(qwen_tokenizer), load_tokenizer(str(qwen_tokenizer))
    prompt = template.prompt(CONVO[:2])
    assert tok.decode(prompt).endswith("assistant\n") and template.stop_strings == ()
    im_end = tok.special_id("<|im_end|>")
    assert template.stop_ids[:2] == (im_end, tok.special_id("<|endoftext|>"))
    answer = np.concatenate([tok.encode("x = 1"), [im_end], tok.encode("junk")])
    assert template.answer_text(answer) == "x = 1" and template.answer_text(tok.encode("no stop")) == "no stop"
    assert template.key == template_of(qwen_tokenizer).key != ChatTemplate.key  # names the template in cache keys


def test_bad_inputs(gemma_tokenizer, tmp_path):
    template = template_of(gemma_tokenizer)
    # Gemma's template folds the system prompt into the first user turn, and refuses two user turns in a row
    assert template._text(CONVO[:2], True).startswith("<bos><start_of_turn>user\nBe brief. Answer in Python.\n\n")
    with pytest.raises(
        UserError, match=f"chat template '{gemma_tokenizer / 'chat_template.jinja'}': Conversation roles must alternate"
    ) as e:
        template.render([CONVO[1], CONVO[1], CONVO[2]])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="train_on='first'"):
        template.render(CONVO, train_on="first")
    with pytest.raises(ValueError, match="no assistant turn"):
        template.render(CONVO[:2])
    with pytest.raises(ValueError, match="expected a user turn"):
        template.prompt(CONVO[:3])
    broken = with_template(gemma_tokenizer, tmp_path, "{% for m in messages %}{{ m.content }")
    with pytest.raises(UserError, match=f"chat template '{broken / 'chat_template.jinja'}': .*line 1"):
        template_of(broken)


@pytest.mark.parametrize("name", NAMES)
def test_an_episode_continues_with_the_ids_of_the_next_prompt(request, name):
    """The prompt, the answer's own ids (through its end-of-turn token), then the continuation:
    the ids of the prompt of the whole conversation, for every published template here."""
    template = template_of(request.getfixturevalue(name))
    convo = CONVO[:3] + [{"role": "user", "content": "Thanks. And 3 + 4?"}]
    prompt = template.prompt(convo[:2])
    answer = template.tok.encode(convo[2]["content"].strip())  # the template trims it; a model would not write it
    end = template._end_of_turn_ids()[0]
    convo[2] = dict(convo[2], content=convo[2]["content"].strip())
    episode = np.concatenate([prompt, answer, [end], template.continuation(convo[:3], convo[3:])])
    np.testing.assert_array_equal(episode, template.prompt(convo))


def test_a_template_that_rewrites_earlier_turns_cannot_continue(llama3_tokenizer, tmp_path):
    template = template_of(with_template(llama3_tokenizer, tmp_path, DROPS_THINKING))
    convo = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hello"},
        {"role": "user", "content": "Bye"},
    ]
    with pytest.raises(UserError, match="does not render as its continuation"):
        template.continuation(convo[:2], convo[2:])
