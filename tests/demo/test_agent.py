"""The demo's tool-use and asynchronous-RL stage (lm.demo.agent): its environment runs exactly the
calls the task's conversations make, an episode's ids are the SFT conversation's, and the
summary helpers and evidence lines."""

import json
import pathlib

import numpy as np
import pytest

from lm.data import arithmetic
from lm.data.chat import ChatTemplate, content_text
from lm.data.tokenizer import ByteTokenizer
from lm.demo import agent
from lm.demo.evidence import evidence
from lm.infer.serve.tools import ToolSyntax, parse
from lm.train.environments import environment_factory, tool_result


def test_the_environment_lists_the_tasks_tool_and_runs_its_calls():
    env = agent.ArithmeticTool()
    assert [t.definition for t in env.tools] == [arithmetic.TOOL] and agent.NoTool().tools == []
    messages = arithmetic.tool_conversation(347, 29)
    example = {"prompt": messages[1]["content"], "answer": "10063"}
    assert env.reset(example) == [{"role": "user", "content": "What is 347 * 29?"}]
    # the call as the model writes it, parsed as the episode runner parses it
    family = ToolSyntax.of(ChatTemplate.source, {}).family
    _, calls = parse(family, content_text(messages[2]), {t.name for t in env.tools})
    step = env.step(messages[1:2], {"role": "assistant", "content": "", "tool_calls": calls})
    assert not step.done and [m["content"] for m in step.messages] == [messages[3]["content"]] == ["10063"]
    assert tool_result(env.tools, calls[0])["content"] == "10063"
    for answer, reward in (("10063", 1.0), (" 10063\n", 1.0), ("10062", 0.0), ("The answer is 10063", 0.0)):
        step = env.step([], {"role": "assistant", "content": answer})
        assert step.done and step.rewards == {"correct": reward}


def test_the_demos_rl_config_names_the_environment():
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "agent_tiny.py"
    spec = importlib.util.spec_from_file_location("agent_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rl = module.get_config().rl
    assert isinstance(environment_factory(rl.environment)(), agent.ArithmeticTool)
    assert rl.max_new_tokens >= 48  # a call of the calculator takes ~40 tokens of the demo's tokenizer


def test_an_episodes_ids_are_the_sft_conversations():
    """The prompt the environment opens with, the call, the continuation after the tool's result
    and the answer, joined as lm.train.episodes joins them, are the ids SFT trains on."""
    tok = ByteTokenizer()
    template = ChatTemplate.for_tokenizer(tok)
    messages = arithmetic.tool_conversation(512, 37)
    env = agent.ArithmeticTool()
    tools = [t.definition for t in env.tools]
    opening = env.reset({"prompt": arithmetic.question(512, 37), "answer": arithmetic.answer(512, 37)})
    end = list(tok.encode("<|end|>"))
    call = list(tok.encode(content_text(messages[2]))) + end  # sampled, up to its stop marker
    family = ToolSyntax.of(ChatTemplate.source, {}).family
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": parse(family, content_text(messages[2]), {"calc"})[1],
    }
    step = env.step(opening + [turn], turn)
    more = template.continuation(opening + [turn], step.messages, tools)
    answer = list(tok.encode("18944")) + end
    ids = [*template.prompt(opening, tools), *call, *more, *answer]
    want, _ = template.render(messages)
    assert ids == list(want[: len(ids)]) and len(want) - len(ids) == len(tok.encode("\n"))  # the last newline


def test_bootstrap_interval():
    assert agent.bootstrap_interval([1.0] * 50) == pytest.approx((1.0, 1.0))
    values = np.r_[np.ones(200), np.zeros(200)]
    lo, hi = agent.bootstrap_interval(values)
    # the normal approximation: 0.5 +- 1.96 * sqrt(0.25 / 400) = 0.5 +- 0.049
    assert lo == pytest.approx(0.451, abs=0.01) and hi == pytest.approx(0.549, abs=0.01)
    s = agent.scored([1, 0, 1, 1])
    assert s["mean"] == pytest.approx(0.75) and s["n"] == 4 and s["ci95"][0] <= 0.75 <= s["ci95"][1]


def test_run_figures_from_metrics_rows():
    rows = [
        {"step": 0, "eval_reward": 0.5},
        {"step": 1, "tokens_per_s": 200.0, "rollout_wait_share": 0.6, "sampling_share": 0.5},
        {"step": 2, "tokens_per_s": 100.0, "rollout_wait_share": 0.2, "sampling_share": 0.3, "eval_reward": 0.75},
    ]
    out = agent.run_figures(rows, tokens_per_step=100)
    # 1 step at 2 steps/s and 1 at 1 step/s: 2 steps in 1.5 s
    assert out["steps_per_s"] == pytest.approx(2 / 1.5)
    assert out["wait_share"] == pytest.approx(0.4) and out["sampling_share"] == pytest.approx(0.4)
    assert out["curve"] == [[0, 0.5], [2, 0.75]]
    assert agent.run_figures(rows[:1], 100)["wait_share"] is None


def test_evidence_lines(tmp_path):
    cond = lambda m, lo, hi, calls: {"mean": m, "ci95": [lo, hi], "n": 256, "tool_calls": calls}  # noqa: E731
    tools = {
        "rollout_reward": [0.6, 0.65],
        "plot": "agent/grpo/rl.png",
        "steps": {"sft": 135, "grpo": 30},
        "n": 256,
        "conditions": {
            "sft, no tool": cond(0.0, 0.0, 0.0, 0.0),
            "sft, calculator": cond(0.9, 0.86, 0.94, 1.0),
            "grpo, calculator": cond(0.95, 0.92, 0.97, 1.0),
        },
    }
    run = lambda k, m, wait, inside: {  # noqa: E731
        "steps_per_s": 1.0 / (k + 1),
        "wait_share": wait,
        "sampling_share": 0.3,
        "curve": [[0, 0.7], [120, m]],
        "final": {"mean": m, "ci95": [m - 0.05, m + 0.05], "n": 256},
        "inside_sync_interval": inside,
    }
    runs = {"0": run(0, 0.84, None, True), "1": run(1, 0.82, 0.25, True), "2": run(2, 0.7, 0.1, False)}
    staleness = {"runs": runs, "plot": str(tmp_path / "grpo_staleness.png")}
    agent.plot_staleness(runs, tmp_path / "grpo_staleness.png")
    assert (tmp_path / "grpo_staleness.png").stat().st_size > 0
    summary = {"pretrain": {"eval_loss": 1.0, "unigram_baseline": 2.0}, "sft": {}}
    text = evidence(summary | {"agent": tools, "async_rl": staleness}, 256)
    lines = text.splitlines()
    assert "tool use: 'What is 347 * 29?' (3 x 2 digits), 256 held-out prompts" in text
    assert any(
        line.split() == ["sft,", "calculator", "90.0%", "[86.0%,", "94.0%]", "1.00", "tool", "calls", "per", "episode"]
        for line in lines
    )
    assert "reward 0.600 over its first 5 steps, 0.650 over its last 5; curves: agent/grpo/rl.png" in text
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and line.split()[0] in runs}
    assert rows["0"][1:4] == ["1.000", "(30%", "sampling)"] and rows["0"][-1] == "-"
    assert rows["1"][1:3] == ["0.500", "25%"] and rows["1"][-1] == "yes" and rows["2"][-1] == "no"
    assert "no speed-up is expected" in text
    json.dumps(summary | {"agent": tools, "async_rl": staleness})  # the summary file holds it
