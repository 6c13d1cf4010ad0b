"""Environments: tools' schemas and results (errors the model reads, never a crash), the safe
calculator, the built-in environments' steps, and loading a user's environment."""

import pytest

from lm.errors import UserError
from lm.train.environments import Calculator, SingleTurn, Step, Tool, calculate, environment_factory, schema_of
from lm.train.rewards import RewardFn


def lookup(city: str, days: int = 1, metric: bool = True) -> dict:
    """Forecast for a city.

    More text the model does not need."""
    return {"city": city, "days": days}


def test_a_tool_definition_from_its_function():
    tool = Tool(lookup)
    assert tool.definition == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    }
    assert tool({"city": "Oslo", "days": 2}) == '{"city": "Oslo", "days": 2}'
    assert schema_of(lambda x, y=2.0: x)["required"] == ["x"]


@pytest.mark.parametrize(
    "expression, want",
    [("2 + 3 * 4", "14"), ("(1 + 2) ** 3", "27"), ("-7 // 2", "-4"), ("10 / 4", "2.5"), ("7 % 3", "1")],
)
def test_calculate(expression, want):
    assert calculate(expression) == want


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "2 ** 1000", "[1, 2]", "'a' * 3"])
def test_calculate_refuses_what_is_not_small_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculate(expression)


def call(name, arguments, id_="c1"):
    return {"type": "function", "id": id_, "function": {"name": name, "arguments": arguments}}


def test_the_calculator_answers_calls_and_scores_the_answer():
    env = Calculator()
    messages = env.reset({"prompt": "What is 6 * 7?", "answer": "42"})
    assert messages == [{"role": "user", "content": "What is 6 * 7?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [call("calculate", '{"expression": "6 * 7"}')]}
    step = env.step(messages + [turn], turn)
    assert step.messages == [{"role": "tool", "tool_call_id": "c1", "name": "calculate", "content": "42"}]
    assert not step.done
    bad = [call("calculate", '{"expression": "x"}'), call("nope", "{}", "c2"), call("calculate", "{oops", "c3")]
    turn = {"role": "assistant", "content": "", "tool_calls": bad}
    errors = [m["content"] for m in env.step(messages + [turn], turn).messages]
    assert errors[0].startswith("error: ValueError: not arithmetic") and "no tool named 'nope'" in errors[1]
    assert errors[2].startswith("error: JSONDecodeError")
    assert env.step(messages, {"role": "assistant", "content": "It is 42."}) == Step(None, {"correct": 1.0}, True)
    assert env.step(messages, {"role": "assistant", "content": "41"}).rewards == {"correct": 0.0}


def test_reward_functions_as_a_single_turn_environment():
    def length(prompts, completions, answer):
        return [len(c) + len(a) for c, a in zip(completions, answer)]

    env = SingleTurn([RewardFn("length", length, 0.5)])
    messages = env.reset({"prompt": "q", "answer": "abc"})
    assert env.step(messages, {"role": "assistant", "content": "hello"}) == Step(None, {"length": 4.0}, True)


def test_loading_environments(tmp_path):
    assert isinstance(environment_factory("calculator")(), Calculator)
    path = tmp_path / "envs.py"
    echo = "class Echo:\n    def reset(self, e):\n        return []\n\n    def step(self, m, t):\n        return None\n"
    path.write_text(echo + "\n\nclass NoStep:\n    def reset(self, e):\n        return []\n")
    assert type(environment_factory(f"{path}:Echo")()).__name__ == "Echo"
    with pytest.raises(UserError, match=r"rl.environment: .*NoStep makes no step\(\) method"):
        environment_factory(f"{path}:NoStep")
    with pytest.raises(UserError, match="rl.environment: 'calc'; expected module:function"):
        environment_factory("calc")
