"""RL environments: where an episode's turns come from and what they earn.

An environment is any object with

    reset(example: dict) -> list[dict]               the conversation an episode starts from
    step(messages: list[dict], turn: dict) -> Step    after each assistant turn (OpenAI's shape:
                                                      content, and `tool_calls` when it called tools)

and optionally `tools`: a list of `Tool` (a Python callable with a JSON schema), which the chat
template lists for the model and `call_tools` runs. `Step.messages` are the turns that follow
(tool results, a user's reply; None ends the episode), `Step.rewards` its reward terms (summed
over the episode, each logged on its own), `Step.done` ends it too. lm.train.episodes runs the
episodes through the engine, one turn after another, with limits on turns, tokens and tool time.

Built in: `ToolUse` (the assistant calls tools until it answers without a call; the answer is
scored by reward functions), `Calculator` (ToolUse with a safe arithmetic tool, scored by the
numeric answer) and `SingleTurn` (today's reward functions as an environment: one answer, scored).
A user's environment is named as `module:Class` or `path/to/file.py:Class`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import operator
from typing import Callable

from lm.config.userfn import load_function
from lm.errors import UserError

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclasses.dataclass
class Step:
    messages: list[dict] | None = None  # turns before the next answer (None: the episode ends)
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    done: bool = False


class Tool:
    """A Python function the model may call: its name, its description (the docstring's first
    line) and its parameters' JSON schema (from the annotations unless given)."""

    def __init__(self, fn: Callable, name: str | None = None, description: str | None = None, parameters=None):
        self.fn, self.name = fn, name or fn.__name__
        self.description = description if description is not None else (inspect.getdoc(fn) or "").split("\n")[0]
        self.parameters = parameters or schema_of(fn)

    @property
    def definition(self) -> dict:
        """OpenAI's function definition (what the chat template lists)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def __call__(self, arguments: dict) -> str:
        out = self.fn(**arguments)
        return out if isinstance(out, str) else json.dumps(out)


def schema_of(fn: Callable) -> dict:
    """The JSON schema of a function's keyword parameters, from their annotations (default: string)."""
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        annotation = p.annotation if not isinstance(p.annotation, str) else eval(p.annotation, fn.__globals__)  # noqa: S307
        props[name] = {"type": JSON_TYPES.get(annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}


def tool_result(tools: list[Tool], call: dict) -> dict:
    """The tool turn answering one call (OpenAI's shape): the tool's output, or the error a model
    should see (an unknown tool, bad arguments, an exception), never a crash of the run."""
    fn = call["function"]
    by_name = {t.name: t for t in tools}
    try:
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        if fn["name"] not in by_name:
            raise LookupError(f"no tool named {fn['name']!r}")
        content = by_name[fn["name"]](args)
    except Exception as e:  # the model's mistake or the tool's: the model reads it and may try again
        content = f"error: {type(e).__name__}: {e}"
    return {"role": "tool", "tool_call_id": call.get("id", ""), "name": fn["name"], "content": content}


def conversation(example: dict) -> list[dict]:
    """An example's opening turns: its `messages`, or its `prompt` as one user turn."""
    if "messages" in example:
        return [dict(m) for m in example["messages"]]
    return [{"role": "user", "content": example["prompt"]}]


class ToolUse:
    """Multi-turn tool use: each call of an answer is run and its result comes back as a tool
    turn; the first answer without a call ends the episode and `score(example, answer_text)`
    gives its reward terms."""

    def __init__(self, tools: list[Tool], score: Callable[[dict, str], dict]):
        self.tools, self.score = tools, score
        self._example = None

    def reset(self, example: dict) -> list[dict]:
        self._example = example
        return conversation(example)

    def step(self, messages: list[dict], turn: dict) -> Step:
        if turn.get("tool_calls"):
            return Step([tool_result(self.tools, c) for c in turn["tool_calls"]])
        return Step(None, self.score(self._example, turn["content"]), done=True)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression (+ - * / // % ** and parentheses)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(value(ast.parse(expression, mode="eval").body))


class Calculator(ToolUse):
    """Arithmetic word problems with a calculator tool; reward `correct`: 1 when the answer's
    number equals the example's `answer` (lm.train.verifiers.numeric_match)."""

    def __init__(self):
        from lm.train.verifiers import numeric_match

        def score(example: dict, answer: str) -> dict:
            return {"correct": float(numeric_match([None], [answer], answer=[example["answer"]])[0])}

        super().__init__([Tool(calculate)], score)


class SingleTurn:
    """Reward functions (lm.train.rewards.RewardFn, TRL's signature) as an environment: one
    answer, scored by each function (times its weight) on its own."""

    def __init__(self, functions):
        self.functions, self.tools = functions, []
        self._example = None

    def reset(self, example: dict) -> list[dict]:
        self._example = example
        return conversation(example)

    def step(self, messages: list[dict], turn: dict) -> Step:
        columns = {k: [v] for k, v in self._example.items() if k not in ("prompt", "messages")}
        prompt = self._example.get("messages", self._example.get("prompt"))
        rewards = {f.name: f.weight * float(f.fn([prompt], [turn["content"]], **columns)[0]) for f in self.functions}
        return Step(None, rewards, done=True)


BUILT_IN = {"calculator": Calculator}


def environment_factory(target: str, label: str = "rl.environment") -> Callable[[], object]:
    """What makes one environment per episode, from `calculator` (built in), `module:Class` or
    `path/to/file.py:Class` (a class, or any function returning an environment)."""
    make = BUILT_IN.get(target) or load_function(target, label)
    env = make()
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise UserError(
                f"{label}: {target} makes no {method}() method; expected an environment (lm.train.environments)"
            )
    return make
