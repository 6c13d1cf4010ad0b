"""Multi-turn episodes through the engine: a row holds the very ids sampled, between them the
template's continuation; the sampled ids' log-probs are the model's on that row; tool calls are
parsed and answered; limits end episodes with their reasons; later turns reuse cached pages."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.data.chat import ChatTemplate, content_text
from lm.data.tokenizer import ByteTokenizer
from lm.infer.engine.engine import Engine, EngineConfig
from lm.infer.sampling import SamplingParams
from lm.model.apply import token_logprobs
from lm.model.transformer import Transformer
from lm.train.environments import Step, Tool, ToolUse
from lm.train.episodes import EpisodeRunner, Limits, episode_metrics, episode_rows
from tests.model.test_transformer import model_spec, random_params

TOK = ByteTokenizer()
SPEC = model_spec(
    vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=512
)
STOPS = (10, 194, 220, 178)  # frequent early tokens of this random model: its answers end within a few tokens
EXAMPLES = [{"prompt": "hi"}, {"prompt": "what?"}, {"prompt": "2+2"}]


class Stops:
    """The byte template, its answers ended by STOPS (a random model rarely writes EOS)."""

    def __init__(self, template):
        self.template, self.stop_ids = template, STOPS

    def __getattr__(self, name):
        return getattr(self.template, name)


class Chat:
    """Replies 'more' to every answer, one reward per answer."""

    tools = []

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages, turn):
        return Step([{"role": "user", "content": "more"}], {"answers": 1.0})


@pytest.fixture(scope="module")
def model():
    m = Transformer(SPEC)
    return m, random_params(m, seed=3)


def runner(model, limits=Limits(turns=3), temperature=1.0, slots=2):
    engine = Engine(model[0], max_len=512, config=EngineConfig(slots=slots, page_size=8))
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature)
    return EpisodeRunner(engine, Stops(ChatTemplate.for_tokenizer(TOK)), sampling, limits)


def test_a_row_holds_the_ids_sampled_and_their_logps_are_the_models_on_it(model):
    run = runner(model)
    episodes = run(model[1], Chat, EXAMPLES, jax.random.PRNGKey(0))
    template = ChatTemplate.for_tokenizer(TOK)
    for ep in episodes:
        assert ep.end in ("turns", "length") and 1 <= ep.turns <= 3
        assert ep.rewards.get("answers", 0.0) == (ep.turns if ep.end == "turns" else ep.turns - 1)
        # the row = prompt, then per answer: its ids, the continuation (all but after the last)
        want, at = list(template.prompt(ep.messages[:1])), len(template.prompt(ep.messages[:1]))
        for turn in range(ep.turns):
            n = next(i for i in range(at, len(ep.ids)) if not ep.trained[i]) - at if turn < ep.turns - 1 else None
            answer = ep.ids[at : at + n] if n is not None else ep.ids[at:]
            want += answer
            if n is not None:
                more = template.continuation(
                    [{"role": "assistant", "content": "x"}], [{"role": "user", "content": "more"}]
                )
                want += list(more)
                at += n + len(more)
        assert ep.ids == want
    assert run.engine.prefix.stats["hit_tokens"] > 0  # later turns found earlier pages
    rows = episode_rows(episodes, 256)
    logp = np.asarray(token_logprobs(model[0], model[1], {k: jnp.asarray(v) for k, v in rows.items()}))
    mask = rows["loss_mask"] > 0
    assert mask.sum() == sum(sum(ep.trained) for ep in episodes)
    np.testing.assert_allclose(rows["old_logp"][mask], logp[mask], atol=2e-4 * max(1.0, np.abs(logp[mask]).max()))


def test_limits_end_episodes_with_their_reasons(model):
    one = runner(model, Limits(turns=1))(model[1], Chat, EXAMPLES, jax.random.PRNGKey(0))
    assert {ep.end for ep in one} <= {"turns", "length"} and all(ep.turns == 1 for ep in one)
    greedy = dict(temperature=0)  # (these random answers end at once, so every episode has a second turn to refuse)
    short = runner(model, Limits(turns=9, tokens=60), **greedy)(model[1], Chat, EXAMPLES, jax.random.PRNGKey(0))
    assert [(ep.end, ep.turns) for ep in short] == [("tokens", 1)] * 3 and all(len(ep.ids) <= 60 for ep in short)

    class Slow(Chat):
        def step(self, messages, turn):
            time.sleep(5)  # far past the limit below
            return super().step(messages, turn)

    slow = runner(model, Limits(turns=3, tool_seconds=0.2), **greedy)(model[1], Slow, EXAMPLES, jax.random.PRNGKey(0))
    assert [(ep.end, ep.turns) for ep in slow] == [("tool_time", 1)] * 3
    metrics = episode_metrics(one + slow)
    assert sum(v for k, v in metrics.items() if k.startswith("episode/end/")) == pytest.approx(1.0)


def test_tool_calls_are_parsed_answered_and_continued(model):
    """A scripted answer (the ids of a call) goes through the runner's parsing and the environment."""
    run = runner(model)
    weather = Tool(lambda city: f"rain in {city}", name="weather", description="Weather")
    env = ToolUse([weather], lambda example, answer: {"score": 1.0})
    messages = env.reset({"prompt": "Paris?"})
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    text = content_text({"role": "assistant", "content": "Let me look.", "tool_calls": [call]})
    from lm.train.episodes import Episode

    ep = Episode(env, messages, [weather.definition], [1], [False], [0.0], np.zeros(2, np.uint32))
    turn = run._turn(ep, list(TOK.encode(text)))
    assert turn["content"] == "Let me look." and ep.tool_calls == 1
    step = env.step(messages + [turn], turn)
    assert step.messages[0]["role"] == "tool" and step.messages[0]["content"] == "rain in Paris"
    assert env.step(messages, {"role": "assistant", "content": "It rains."}).rewards == {"score": 1.0}
