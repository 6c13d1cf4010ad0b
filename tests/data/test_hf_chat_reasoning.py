"""Qwen3's published chat template (tests/data/qwen3_chat_template.jinja, as Qwen/Qwen3-* ship it):
it drops the <think> reasoning of assistant turns before the last user query, so a conversation
renders an earlier turn otherwise than the model wrote it. Every assistant turn is trained as it
renders from its own prefix: the last in the whole conversation, each rewritten one as an example of
its own. Masks are checked by hand against transformers' apply_chat_template text and offsets."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lm.config.sft import SftSettings
from lm.data.chat import ChatTemplate
from lm.data.sft import prepare_sft
from lm.data.tokenizer import load_tokenizer

pytest.importorskip("transformers")
QWEN3 = Path(__file__).with_name("qwen3_chat_template.jinja")
REASONING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n5"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "reasoning_content": "5 times 4.", "content": "20"},
]
TOOLS = [  # reasoning after the last user query stays: every turn is in place
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "reasoning_content": "Look it up.",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "18C"},
    {"role": "assistant", "reasoning_content": "Report it.", "content": "18C in Paris."},
]


@pytest.fixture(scope="module")
def qwen3(qwen_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "tok"
    shutil.copytree(qwen_tokenizer, out)
    (out / "chat_template.jinja").write_text(QWEN3.read_text())
    return out


def auto(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def by_hand(hf, messages):
    """transformers' rendering of `messages` with its last turn weighted: from the end of the
    generation prompt of messages[:-1] through the first <|im_end|> after it. Returns the ids,
    the weights and the weighted text."""
    text = hf.apply_chat_template(messages, tokenize=False)
    prompt = hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt)
    start, end = len(prompt), text.index("<|im_end|>", len(prompt)) + len("<|im_end|>")
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    weights = [float(a < end and b > start) for a, b in encoded["offset_mapping"]]
    return encoded["input_ids"], weights, text[start:end]


def test_earlier_reasoning_is_dropped_by_the_template(qwen3):
    full = auto(qwen3).apply_chat_template(REASONING, tokenize=False)
    assert "Add them." not in full and "<|im_start|>assistant\n5<|im_end|>" in full
    assert "<think>\n5 times 4.\n</think>\n\n20<|im_end|>" in full
    assert ChatTemplate.for_tokenizer(load_tokenizer(str(qwen3)))._text(REASONING) == full


def test_every_turn_trained_from_its_own_prefix(qwen3):
    hf, template = auto(qwen3), ChatTemplate.for_tokenizer(load_tokenizer(str(qwen3)))
    whole, own = template.examples(REASONING)
    assert (whole.turns, whole.own_prefix, own.turns, own.own_prefix) == (1, False, 1, True)
    for example, messages, trained in (
        (whole, REASONING, "<think>\n5 times 4.\n</think>\n\n20<|im_end|>"),
        (own, REASONING[:3], "<think>\nAdd them.\n</think>\n\n5<|im_end|>"),  # its reasoning is learnt
    ):
        ids, weights, text = by_hand(hf, messages)
        assert text == trained
        assert example.ids.tolist() == ids and example.weights.tolist() == weights
        assert hf.decode(example.ids[example.weights > 0]) == trained
    (last,) = template.examples(REASONING, "last")
    assert last.ids.tolist() == whole.ids.tolist() and last.weights.tolist() == whole.weights.tolist()


def test_turns_the_template_keeps_stay_in_one_example(qwen3):
    hf, template = auto(qwen3), ChatTemplate.for_tokenizer(load_tokenizer(str(qwen3)))
    (example,) = template.examples(TOOLS)
    assert example.turns == 2 and not example.own_prefix
    ids, last_weights, _ = by_hand(hf, TOOLS)
    _, first_weights, first = by_hand(hf, TOOLS[:2])
    assert first.startswith("<think>\nLook it up.\n</think>\n\n<tool_call>\n") and first.endswith("<|im_end|>")
    want = np.array(last_weights)
    want[: len(first_weights)] += first_weights
    assert example.ids.tolist() == ids and example.weights.tolist() == want.tolist()


def test_an_empty_assistant_turn_renders_as_transformers_renders_it(qwen3):
    hf, template = auto(qwen3), ChatTemplate.for_tokenizer(load_tokenizer(str(qwen3)))
    convo = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    ids, weights = template.render(convo)
    want_ids, want_weights, text = by_hand(hf, convo)
    assert text == "<think>\n\n</think>\n\n<|im_end|>"
    assert ids.tolist() == want_ids == hf.apply_chat_template(convo, return_dict=False)
    assert weights.tolist() == want_weights


def test_sft_counts_the_turns_and_says_so_once(qwen3, tmp_path, capsys):
    path = tmp_path / "reasoning.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (REASONING, TOOLS, REASONING)))
    examples = prepare_sft(path, load_tokenizer(str(qwen3)), SftSettings(seq_len=256), tmp_path / "cache")
    assert len(examples) == 5
    stats = examples.stats
    assert (stats["examples_read"], stats["turns_trained"], stats["turns_own_prefix"]) == (5, 6, 2)
    err = capsys.readouterr().err
    assert err.count("trained from its own prefix") == 1 and "2 of 6 trained turns" in err
