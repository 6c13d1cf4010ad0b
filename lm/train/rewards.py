"""Rewards of RL rollouts: Python functions (verifiable tasks), a trained reward model, and a
penalty for responses cut at the length limit, combined with weights.

A reward function is named in `rl.rewards` as `module:function` or `path/to/file.py:function`,
optionally `=weight` (default 1), several separated by commas. It is called once per rollout
batch, as TRL's are:

    fn(prompts: list, completions: list[str], **columns) -> list[float]

prompts: each row's prompt as in the file (a string or chat messages); completions: the
response texts; columns: every other key of the prompt lines, one list per key (e.g. `answer`).
`rl.reward_model` (an `lm reward` run or export) adds its score of the whole conversation,
times `rl.reward_model_weight`. Each source's raw rewards are logged as `reward/<name>`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from lm.errors import UserError
from lm.infer.score import RewardScorer
from lm.store.load import load_init
from lm.userfn import load_function


@dataclasses.dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float


def parse_rewards(text: str) -> list[RewardFn]:
    """`a:f=0.5, b.py:g` -> RewardFns (weight 1 when not given)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        target, _, weight = item.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"rl.rewards: weight '{weight}' of '{target}' is not a number") from None
        out.append(RewardFn(target.rpartition(":")[2], load_function(target.strip()), w))
    return out


class Rewards:
    """Scores a rollout batch: (total reward [N], {source: raw rewards [N]})."""

    def __init__(self, functions: list[RewardFn], scorer=None, scorer_weight: float = 1.0,
                 truncation_penalty: float = 0.0, model=None):
        if not functions and scorer is None and model is None:
            raise UserError("rl: no reward; set rl.rewards (module:function) and/or rl.reward_model")
        self.functions, self.scorer, self.scorer_weight = functions, scorer, scorer_weight
        self.truncation_penalty, self.model = truncation_penalty, model

    @classmethod
    def from_config(cls, r) -> Rewards:
        """The functions (imported now) and the reward model (read now, placed by `place`)."""
        model = load_init(r.reward_model) if r.reward_model else None
        return cls(parse_rewards(r.rewards), None, r.reward_model_weight, r.truncation_penalty, model)

    def place(self, mesh) -> None:
        """The reward model, frozen, on the policy's mesh (its own architecture and rule table)."""
        if self.model is not None:
            self.scorer = RewardScorer(self.model, mesh=mesh)

    def __call__(self, prompts: list, messages: list[list[dict]], completions: list[str], truncated: np.ndarray,
                 columns: list[dict]) -> tuple[np.ndarray, dict]:
        n = len(completions)
        keys = sorted({k for c in columns for k in c})
        kwargs = {k: [c.get(k) for c in columns] for k in keys}
        total, parts = np.zeros(n, np.float64), {}
        for f in self.functions:
            try:
                values = np.asarray(f.fn(prompts, completions, **kwargs), np.float64).reshape(-1)
            except Exception as e:  # a user's function: say whose it is
                raise UserError(f"reward function '{f.name}' failed: {type(e).__name__}: {e}") from e
            if len(values) != n or not np.all(np.isfinite(values)):
                raise UserError(f"reward function '{f.name}' returned {len(values)} values for {n} completions "
                                "(expected one finite float each)")
            parts[f.name] = values
            total += f.weight * values
        if self.scorer is not None:
            conversations = [m + [{"role": "assistant", "content": c}] for m, c in zip(messages, completions)]
            parts["reward_model"] = self.scorer.score(conversations).astype(np.float64)
            total += self.scorer_weight * parts["reward_model"]
        if self.truncation_penalty:
            total -= self.truncation_penalty * truncated.astype(np.float64)
        return total.astype(np.float32), parts
