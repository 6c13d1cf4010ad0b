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

`rl.reward_url` adds an HTTP endpoint's rewards (lm.train.reward_http), times `rl.reward_weight`,
logged as `reward/http`.

A function that raises stops the run with its own traceback; to name the completion that made it
raise, it is then called again on each completion alone. A value that is not a finite number, or
a list of the wrong length, stops the run naming the completion or the counts.

Rewards from outside fail in ways no code of the user's can fix: an endpoint that stays down
after its retries, or that answers null for a row. Such a row's reward is NaN here, never a
stand-in 0 (a fake 0 would shift its group's mean and std): the row is left out of the update
(lm.train.rl_step), counted per source, and `RewardFailures` stops the run once the share of
failed rollouts passes `rl.max_reward_failures`. A failed source of weight 0 (logged only)
excludes no row.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Callable

import jax
import numpy as np

from lm.config.userfn import load_function
from lm.errors import UserError
from lm.infer.score import RewardScorer
from lm.store.load import load_init
from lm.train.reward_http import HttpReward

HTTP_NAME = "http"  # the endpoint's source name: reward/http


@dataclasses.dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float
    target: str = ""  # as written in rl.rewards (module:function or file.py:function), or the URL
    external: bool = False  # a service (lm.train.reward_http): None rows fail, its UserErrors pass through

    def label(self) -> str:
        return f"'{self.name}'" + (f" ({self.target})" if self.target and self.target != self.name else "")


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
        target = target.strip()
        out.append(RewardFn(target.rpartition(":")[2], load_function(target), w, target))
    return out


class Rewards:
    """Scores a rollout batch: (total reward [N], {source: raw rewards [N]})."""

    def __init__(
        self,
        functions: list[RewardFn],
        scorer=None,
        scorer_weight: float = 1.0,
        truncation_penalty: float = 0.0,
        model=None,
    ):
        if not functions and scorer is None and model is None:
            raise UserError("rl: no reward; set rl.rewards (module:function), rl.reward_url and/or rl.reward_model")
        names = [f.name for f in functions] + (["reward_model"] if scorer is not None or model is not None else [])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"rl.rewards: two reward sources named {twice[0]!r}; each is logged as reward/<name>")
        self.functions, self.scorer, self.scorer_weight = functions, scorer, scorer_weight
        self.truncation_penalty, self.model = truncation_penalty, model
        self.errors: dict[str, str] = {}  # why each source's rows failed in the last call

    @classmethod
    def from_config(cls, r) -> Rewards:
        """The functions (imported now), the endpoint and the reward model (read now, placed by `place`)."""
        model = load_init(r.reward_model) if r.reward_model else None
        functions = parse_rewards(r.rewards)
        if r.reward_url:
            endpoint = HttpReward(r.reward_url, r.reward_timeout, r.reward_retries)
            functions.append(RewardFn(HTTP_NAME, endpoint, r.reward_weight, r.reward_url, external=True))
        return cls(functions, None, r.reward_model_weight, r.truncation_penalty, model)

    @property
    def failable(self) -> list[str]:
        """The sources whose rows may fail (counted as reward/<name>/failed)."""
        return [f.name for f in self.functions if f.external] + (["reward_model"] if self.scorer is not None else [])

    def place(self, mesh) -> None:
        """The reward model, frozen, on the policy's mesh (its own architecture and rule table)."""
        if self.model is not None:
            self.scorer = RewardScorer(self.model, mesh=mesh)

    def __call__(
        self,
        prompts: list,
        messages: list[list[dict]],
        completions: list[str],
        truncated: np.ndarray,
        columns: list[dict],
    ) -> tuple[np.ndarray, dict]:
        n = len(completions)
        keys = sorted({k for c in columns for k in c})
        kwargs = {k: [c.get(k) for c in columns] for k in keys}
        total, parts = np.zeros(n, np.float64), {}
        values = (
            on_main(
                lambda: np.stack([call_reward(f, prompts, completions, kwargs) for f in self.functions]),
                (len(self.functions), n),
            )
            if self.functions
            else ()
        )
        weights = {}
        for f, v in zip(self.functions, values):
            parts[f.name], weights[f.name] = v, f.weight
        if self.scorer is not None:
            conversations = [m + [{"role": "assistant", "content": c}] for m, c in zip(messages, completions)]
            parts["reward_model"] = self.scorer.score(conversations).astype(np.float64)
            weights["reward_model"] = self.scorer_weight
        for name, v in parts.items():
            if weights[name]:  # NaN (a failed row) stays NaN in the total; a weight-0 source is logged only
                total += weights[name] * v
        if self.truncation_penalty:
            total -= self.truncation_penalty * truncated.astype(np.float64)
        self.errors = self._errors(parts)
        return total.astype(np.float32), parts

    def _errors(self, parts: dict) -> dict[str, str]:
        """Why each source failed on some rows of the last call (process 0 alone knows an endpoint's)."""
        out = {f.name: f.fn.last_error for f in self.functions if f.external and getattr(f.fn, "last_error", "")}
        for name, v in parts.items():
            if name not in out and np.isnan(v).any():
                label = next((f.label() for f in self.functions if f.name == name), f"'{name}'")
                out[name] = f"{label} failed on {int(np.isnan(v).sum())} of {len(v)} completions"
        return out


def on_main(compute: Callable[[], np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """float64 `shape`: compute() on process 0 alone, its values sent to the others bit for bit.

    Every process holds every rollout, so each could call the reward functions itself; but a
    function may be random or call a service (a judge, a sandbox), and then processes would
    disagree silently (a group's advantages mixing two draws) or pay for every call once per
    process. A function that raises on process 0 stops every process."""
    if jax.process_count() == 1:
        return compute()
    from jax.experimental import multihost_utils

    values, error = np.zeros(shape, np.float64), None
    if jax.process_index() == 0:
        try:
            values = np.asarray(compute(), np.float64).reshape(shape)
        except Exception as e:  # any: raised below, once the other processes know to stop
            error = e
    if multihost_utils.broadcast_one_to_all(np.int32(error is not None)):
        raise error or UserError("rl: a reward function failed on process 0 (see its error there)")
    bits = multihost_utils.broadcast_one_to_all(values.view(np.uint32))  # float64 survives jax's default float32
    return np.asarray(bits, np.uint32).view(np.float64).reshape(shape)


def call_reward(f: RewardFn, prompts: list, completions: list[str], columns: dict) -> np.ndarray:
    """A user's reward function on a batch -> its rewards [N]; a UserError naming the function and
    the completion when it raises (with its traceback) or returns something other than N finite floats."""
    if f.external:  # its errors already name the service; a failed row is None (NaN here)
        return reward_values(f, f.fn(prompts, completions, **columns), len(completions))
    try:
        out = f.fn(prompts, completions, **columns)
    except Exception as e:
        raise UserError(_raised(f, e, prompts, _failing_row(f, prompts, completions, columns))) from e
    return reward_values(f, out, len(completions))


def reward_values(f: RewardFn, out, n: int) -> np.ndarray:
    """A reward function's return value -> float64 [n], or a UserError saying what is wrong with it."""
    head = f"reward function {f.label()} returned"
    if isinstance(out, np.ndarray):
        out = out.reshape(-1)
    elif isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise UserError(
            f"{head} {type(out).__name__} {_short(out)} for {n} completions; expected a list of "
            f"{n} floats, one per completion"
        )
    if len(out) != n:
        raise UserError(f"{head} {len(out)} values for {n} completions; expected one float per completion")
    values = np.zeros(n, np.float64)
    for i, v in enumerate(out):
        if v is None and f.external:
            values[i] = np.nan  # failed: the row leaves the update (see the module doc)
            continue
        try:
            values[i] = float(v)
        except (TypeError, ValueError):
            raise UserError(f"{head} {_short(v)} for completion {i}; expected a float") from None
        if not np.isfinite(values[i]):
            raise UserError(f"{head} {values[i]} for completion {i}; expected a finite float")
    return values


def _failing_row(f: RewardFn, prompts: list, completions: list[str], columns: dict) -> int | None:
    """The first completion on which the function raises when called on it alone (None: none does)."""
    for i in range(len(completions)):
        try:
            f.fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
        except Exception:
            return i
    return None


def _raised(f: RewardFn, error: BaseException, prompts: list, row: int | None) -> str:
    """One line naming the function, the completion and the error, then the function's traceback
    (its own frames, from a new line)."""
    n = len(prompts)
    where = (
        f"on completion {row} of {n} (prompt {_short(prompts[row])})"
        if row is not None
        else f"on a batch of {n} completions (on none of them alone)"
    )
    frames = "".join(traceback.format_exception(type(error), error, error.__traceback__.tb_next)).rstrip()
    message = " ".join(str(error).split())
    message = message if len(message) <= 200 else message[:197] + "..."
    return f"reward function {f.label()} raised {type(error).__name__} {where}: {message}\n{frames}"


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
