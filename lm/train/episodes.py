"""Multi-turn episodes through the engine: each episode's answers are sampled, its environment
(lm.train.environments) answers them (tool results, a user's reply), and the next answer is
sampled after the episode's ids so far, until the environment ends it or a limit does.

An episode is one row of ids: its prompt, each sampled answer as sampled (its end-of-turn id
included: the ids are never re-encoded from text), and between answers the chat template's
continuation (`template.continuation`: the new turns and the next generation prompt). Only the
sampled ids are trained on; their log-probs are the sampler's. An episode's next answer is
queued once its environment has answered, while the other episodes keep generating (no barrier
between turns), and each next prompt starts with the whole previous one, so the engine's prefix cache finds its pages
(lm.infer.engine.prefix) rather than prefilling the conversation again.

The environments' steps of the answers that ended in the same engine step run at once, on
threads; the episodes then go on in the order their answers ended, so a run does not depend on
how long the steps took (within their limit).

Limits end an episode with a counted reason, never a crash: `done` (the environment ended it),
`length` (an answer reached max_new_tokens), `turns`, `tokens` (the next prompt would not fit),
`tool_time` (the environment's step ran past its time limit: its result is dropped).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from lm.errors import UserError
from lm.infer.engine.engine import Engine, EngineConfig, Request
from lm.infer.sampling import SamplingParams
from lm.infer.serve.tools import ToolSyntax, parse
from lm.train.rollout import Rollouts

END_REASONS = ("done", "length", "turns", "tokens", "tool_time")


@dataclasses.dataclass(frozen=True)
class Limits:
    turns: int = 4  # answers per episode
    tokens: int = 0  # ids per episode (0: the engine's max_len)
    tool_seconds: float = 30.0  # the environment's time per step


@dataclasses.dataclass
class Episode:
    env: object
    messages: list[dict]
    tools: list[dict] | None
    ids: list[int]
    trained: list[bool]
    logps: list[float]
    key: np.ndarray
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    end: str | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.rewards.values()))


class EpisodeRunner:
    """Runs a batch of episodes over one engine (whose prefix cache serves the later turns)."""

    def __init__(self, engine, template, sampling: SamplingParams, limits: Limits = Limits()):
        self.engine, self.template, self.sampling, self.limits = engine, template, sampling, limits
        specials = template.tok.special_tokens() if hasattr(template.tok, "special_tokens") else {}
        self.syntax = ToolSyntax.of(getattr(template, "source", None), specials)
        self.max_len = min(limits.tokens or engine.max_len, engine.max_len)
        self._pool = None  # the environments' steps run here, each within limits.tool_seconds

    def __call__(self, params, make_env, examples: list[dict], rng) -> list[Episode]:
        keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(rng, i))(np.arange(len(examples))), np.uint32)
        episodes, ended = [], []
        for example, key in zip(examples, keys):
            env = make_env()
            messages = env.reset(example)
            tools = [t.definition for t in getattr(env, "tools", [])] or None
            ids = [int(i) for i in self.template.prompt(messages, tools)]
            episodes.append(Episode(env, messages, tools, ids, [False] * len(ids), [0.0] * len(ids), key))
        for ep in episodes:
            if len(ep.ids) < self.max_len:
                self._submit(ep, ended)
            else:  # the opening prompt (tools listed) leaves no room for an answer
                ep.end = "tokens"
        prepared = self.engine.prepare(params)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(episodes), thread_name_prefix="env")
        try:
            while self.engine.busy:
                self.engine.step(prepared)
                answered, ended[:] = list(ended), []
                self._advance(answered, ended)
        finally:  # a step past its time limit is left to finish on its own; nothing waits for it
            self._pool.shutdown(wait=False, cancel_futures=True)
        return episodes

    def _submit(self, ep: Episode, ended: list) -> None:
        room = self.max_len - len(ep.ids)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, room))
        key = np.asarray(jax.random.fold_in(ep.key, ep.turns), np.uint32)
        done = lambda r: ended.append((ep, r))  # noqa: E731 (processed between engine steps)
        self.engine.add(Request(list(ep.ids), sampling, self.template.stop_ids, key=key, on_done=done))

    def _advance(self, answered: list, ended: list) -> None:
        """The answers that ended in one engine step: their environments' steps run at once (each
        within limits.tool_seconds), then each episode, in the order its answer ended, asks for
        its next answer or ends (so a run does not depend on the steps' timing)."""
        stepping = []
        for ep, r in answered:
            ep.ids += r.ids
            ep.trained += [True] * len(r.ids)
            ep.logps += r.logps
            ep.turns += 1
            if r.finish != "eos":
                ep.end = "length"
                continue
            turn = self._turn(ep, r.ids)
            stepping.append((ep, turn, self._pool.submit(ep.env.step, ep.messages + [turn], turn)))
        deadline = time.monotonic() + self.limits.tool_seconds
        for ep, turn, future in stepping:
            try:
                step = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                ep.end = "tool_time"
                continue
            self._continue(ep, turn, step, ended)

    def _continue(self, ep: Episode, turn: dict, step, ended: list) -> None:
        for name, value in step.rewards.items():
            ep.rewards[name] = ep.rewards.get(name, 0.0) + float(value)
        if step.done or step.messages is None:
            ep.end = "done"
            return
        if ep.turns >= self.limits.turns:
            ep.end = "turns"
            return
        more = self.template.continuation(ep.messages + [turn], step.messages, ep.tools)
        if len(ep.ids) + len(more) >= self.max_len:
            ep.end = "tokens"
            return
        ep.messages += [turn] + step.messages
        ep.ids += [int(i) for i in more]
        ep.trained += [False] * len(more)
        ep.logps += [0.0] * len(more)
        self._submit(ep, ended)

    def _turn(self, ep: Episode, ids) -> dict:
        """The answer as an assistant message: its text, and its tool calls when the episode has tools."""
        text = self.template.answer_text(ids)
        family = self.syntax.family
        if ep.tools and family is not None:
            names = {t["function"]["name"] for t in ep.tools}
            parsed = parse(family, text, names)
            if parsed is not None:
                ep.tool_calls += len(parsed[1])
                return {"role": "assistant", "content": parsed[0].strip(), "tool_calls": parsed[1]}
        return {"role": "assistant", "content": text}


def episode_rows(episodes: list[Episode], seq_len: int) -> dict:
    """Update rows [B, seq_len] of episodes: the text contract, `loss_mask` on the sampled ids
    (as targets), `old_logp` their sampling log-probs. Ids past seq_len are cut (and untrained)."""
    b = len(episodes)
    rows = {k: np.zeros((b, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    rows["loss_mask"] = np.zeros((b, seq_len), np.float32)
    rows["old_logp"] = np.zeros((b, seq_len), np.float32)
    for i, ep in enumerate(episodes):
        ids = np.asarray(ep.ids[: seq_len + 1], np.int32)
        n = len(ids) - 1
        rows["inputs"][i, :n], rows["targets"][i, :n] = ids[:-1], ids[1:]
        rows["segment_ids"][i, :n], rows["positions"][i, :n] = 1, np.arange(n)
        rows["loss_mask"][i, :n] = np.asarray(ep.trained[1 : n + 1], np.float32)
        rows["old_logp"][i, :n] = np.asarray(ep.logps[1 : n + 1], np.float32) * rows["loss_mask"][i, :n]
    return rows


def episode_metrics(episodes: list[Episode]) -> dict:
    """Turns, tool calls, ids and end reasons (shares) of a batch of episodes."""
    n = max(1, len(episodes))
    out = {
        "episode/turns": float(np.mean([e.turns for e in episodes])),
        "episode/tool_calls": float(np.mean([e.tool_calls for e in episodes])),
        "episode/length": float(np.mean([len(e.ids) for e in episodes])),
    }
    return out | {f"episode/end/{reason}": sum(e.end == reason for e in episodes) / n for reason in END_REASONS}


class EpisodeRollouts:
    """The multi-turn rollouts of an RL step (lm.train.rl_step): episodes of the policy on the
    run's mesh, one engine per call (its prefix cache serves the later turns), as update rows
    with their rewards (each term on its own) and the episodes' metrics."""

    def __init__(self, sampler, template, make_env, limits: Limits, seq_len: int, truncation_penalty: float = 0.0):
        self.sampler, self.template, self.make_env, self.limits = sampler, template, make_env, limits
        self.seq_len, self.truncation_penalty = seq_len, truncation_penalty

    def __call__(self, params, examples: list[dict], rng, sampling: SamplingParams | None = None):
        """(Rollouts, total reward [N], {term: [N]}, metrics)."""
        s, slots = self.sampler, len(examples)
        engine = Engine(s.model, max_len=self.seq_len, config=EngineConfig(slots=slots), mesh=s.mesh, rules=s.rules)
        runner = EpisodeRunner(engine, self.template, sampling or self.sampler.sampling, self.limits)
        episodes = runner(params, self.make_env, examples, rng)
        if not any(e.turns for e in episodes):
            longest = max(len(e.ids) for e in episodes)
            raise UserError(
                f"rl.environment: no episode had room for an answer: opening prompts (the environment's tools "
                f"listed) take up to {longest} tokens of the {runner.max_len} an episode may hold; raise "
                "data.seq_len (and the model's context) or rl.max_episode_tokens"
            )
        rows = episode_rows(episodes, self.seq_len)
        sampled = [np.asarray([i for i, t in zip(e.ids, e.trained) if t], np.int32) for e in episodes]
        ro = Rollouts(rows, sampled, [e.end for e in episodes])
        terms = sorted({k for e in episodes for k in e.rewards})
        parts = {k: np.array([e.rewards.get(k, 0.0) for e in episodes], np.float64) for k in terms}
        total = np.array([e.reward for e in episodes], np.float64) - self.truncation_penalty * ro.truncated
        metrics = episode_metrics(episodes) | {"prefix_hit_rate": engine.prefix.hit_rate}
        return ro, total.astype(np.float32), parts, metrics
