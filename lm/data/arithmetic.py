"""Multi-digit multiplication as chat, with and without a calculator tool: the demo's tool-use task.

"What is 347 * 29?" -> "10063". A 3-digit by 2-digit product is beyond what the demo's 1M-parameter
model computes in its head, but with a calculator it only has to copy: the operands into the
call, the tool's result into the answer. The supervised data mixes two kinds of conversation:

- with the tool (`TOOL`, listed in the system turn as our chat template lists an environment's
  tools): the assistant's first turn is one `<tool_call>` of `calc` on "A * B", then a
  `tool` turn with the result, then the assistant's answer, the result itself;
- without tools: the assistant answers at once.

These are the very turns lm.train.environments' ToolUse produces and expects at RL time (the
demo's environment, lm.demo.agent.ArithmeticTool, lists `TOOL` and runs it with
lm.train.environments.calculate). Held-out
prompts never appear in the training split (the split is by a hash of the operands).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from lm.data.chat import with_tools
from lm.errors import UserError

A_RANGE, B_RANGE = (100, 999), (10, 99)  # inclusive operand ranges: 81,000 products
HELDOUT_BUCKET = 10  # one pair in ten (by hash) may only be held out
# the calculator as the model sees it: short, so that a whole episode fits the tiny model's 256 positions
TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Arithmetic.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def expression(a: int, b: int) -> str:
    return f"{a} * {b}"


def answer(a: int, b: int) -> str:
    return str(a * b)


def is_heldout(a: int, b: int) -> bool:
    return int(hashlib.sha256(expression(a, b).encode()).hexdigest()[:8], 16) % HELDOUT_BUCKET == 0


def operands(n: int, heldout: bool, seed: int) -> list[tuple[int, int]]:
    """n distinct operand pairs of one split."""
    rng = np.random.default_rng(seed)
    seen, out = set(), []
    while len(out) < n:
        pair = (int(rng.integers(A_RANGE[0], A_RANGE[1] + 1)), int(rng.integers(B_RANGE[0], B_RANGE[1] + 1)))
        if pair in seen or is_heldout(*pair) != heldout:
            continue
        seen.add(pair)
        out.append(pair)
    return out


def tool_call(a: int, b: int) -> dict:
    """The assistant's call (OpenAI's shape) of the calculator on the product."""
    arguments = json.dumps({"x": expression(a, b)})
    return {"id": "call_0", "type": "function", "function": {"name": TOOL["function"]["name"], "arguments": arguments}}


def tool_conversation(a: int, b: int) -> list[dict]:
    """Question, call, the tool's result, answer; the tool listed in the system turn."""
    turns = [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(a, b)]},
        {"role": "tool", "tool_call_id": "call_0", "name": TOOL["function"]["name"], "content": answer(a, b)},
        {"role": "assistant", "content": answer(a, b)},
    ]
    return with_tools(turns, [TOOL])


def direct_conversation(a: int, b: int) -> list[dict]:
    """Question and answer, no tools offered."""
    return [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": answer(a, b)}]


def write_arithmetic_task(
    out_dir, n_tool: int = 3000, n_direct: int = 1000, n_prompts: int = 2000, n_heldout: int = 256, seed: int = 0
) -> dict:
    """Writes OUT/sft.jsonl (tool and direct conversations, shuffled), OUT/sft_heldout.jsonl
    (held-out tool conversations: the SFT run's held-out loss), OUT/prompts.jsonl (training
    prompts for RL) and OUT/heldout.jsonl (held-out prompts); prompts carry an `answer` column.
    Returns the paths."""
    if min(n_tool, n_direct, n_prompts, n_heldout) < 1:
        raise UserError(
            f"arithmetic task: n_tool ({n_tool}), n_direct ({n_direct}), n_prompts ({n_prompts}) and "
            f"n_heldout ({n_heldout}) must be >= 1"
        )
    train = operands(n_tool + n_direct + n_prompts, heldout=False, seed=seed)
    heldout = operands(n_heldout, heldout=True, seed=seed + 1)
    sft = [tool_conversation(*p) for p in train[:n_tool]] + [direct_conversation(*p) for p in train[n_tool:-n_prompts]]
    order = np.random.default_rng(seed + 2).permutation(len(sft))
    rows = {
        "sft": [{"messages": sft[i]} for i in order],
        "sft_heldout": [{"messages": tool_conversation(*p)} for p in heldout],
        "prompts": [{"prompt": question(*p), "answer": answer(*p)} for p in train[-n_prompts:]],
        "heldout": [{"prompt": question(*p), "answer": answer(*p)} for p in heldout],
    }
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, lines in rows.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in lines))
    return paths
