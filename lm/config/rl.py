"""The `rl` section (`lm rl`), and `RlSettings`, the loss's frozen form (lm.train.rl_losses)."""

from __future__ import annotations

import dataclasses
import urllib.parse

from lm.config.core import from_section, require

# GRPO or PPO from a trained model (finetune.init) on prompts (finetune.data, finetune.eval_data:
# JSONL {"prompt"} or chat {"messages"} lines, lm.data.prompts). A step samples group_size responses to each of
# prompts_per_step prompts (max_new_tokens, temperature, top_p), scores them (rewards:
# "module:function[=weight], file.py:function"; reward_model: an `lm reward` run or export,
# times reward_model_weight; truncation_penalty off responses cut at max_new_tokens), then makes
# epochs passes over them in minibatches updates (train.batch_size is set to the rows of one).
# beta: KL to the init model (GRPO: k3 term in the loss; PPO: in the per-token reward; 0: no
# reference held); eps_low/eps_high: the clip range; scale_rewards: GRPO divides by the group's
# std (false: Dr. GRPO); PPO: gamma, lam (GAE), vf_coef, value_clip, whiten (advantages to mean 0,
# std 1 over the batch's response tokens). The policy's, the old and the reference log-probs are
# all taken at `temperature` (logits / temperature, as TRL). loss_type: how the per-token loss is
# normalised (TRL's names, lm.train.rl_losses): dapo (over the update's response tokens) | grpo
# (each response's mean, then the mean over responses) | dr_grpo (over responses x
# max_new_tokens) | bnpo (over each micro-batch's tokens); importance_sampling_level: token |
# sequence (GSPO: one ratio per response, exp of the mean log-ratio). eval_prompts held-out
# prompts are answered greedily at every eval. speculate: prompt-lookup drafts per response and
# decode step while sampling (0: off; the responses' distribution is unchanged).
# reward_url: an HTTP endpoint scoring each rollout batch (lm.train.reward_http), times
# reward_weight; reward_timeout seconds per request, reward_retries more tries (backoff) on
# connection errors, timeouts, 5xx and 429. max_reward_failures: the share of rollouts whose
# reward may fail (endpoint down after its retries, or null rows; they leave the update) before
# the run stops; 0 stops at the first.
# environment: multi-turn episodes (lm.train.environments: `calculator`, module:Class or file.py:Class;
# '' = one answer per prompt, scored by the rewards above): each answer may call the environment's
# tools or get a reply, up to max_turns answers and max_episode_tokens ids (0: data.seq_len), each
# environment step within tool_seconds; its steps give the rewards (rl.rewards, reward_url and
# reward_model stay empty).
# max_staleness: k > 0 samples the rollouts of step s+k with the params of step s while step s
# updates (lm.train.rl_async; 0: sample, then update, in turn); the loss corrects for the policy
# that sampled them with importance weights pi_current / pi_sampler per token, is_correction: tis
# (truncated at is_cap) | mis (tokens past is_cap left out) | none.
# generation_devices: g > 0 samples on the last g devices (a mesh of data x generation_tensor)
# and trains on the others (mesh.*); the params are copied across after every update. 0: one mesh.
DEFAULTS = dict(
    algo="grpo",
    prompts_per_step=8,
    group_size=8,
    max_new_tokens=32,
    temperature=1.0,
    top_p=1.0,
    rewards="",
    reward_model="",
    reward_model_weight=1.0,
    truncation_penalty=0.0,
    reward_url="",
    reward_weight=1.0,
    reward_timeout=60.0,
    reward_retries=3,
    max_reward_failures=0.05,
    epochs=1,
    minibatches=1,
    beta=0.04,
    eps_low=0.2,
    eps_high=0.2,
    loss_type="dapo",
    importance_sampling_level="token",
    scale_rewards=True,
    adv_eps=1e-4,
    gamma=1.0,
    lam=0.95,
    vf_coef=0.1,
    value_clip=0.2,
    whiten=True,
    eval_prompts=256,
    speculate=0,
    environment="",
    max_turns=4,
    max_episode_tokens=0,
    tool_seconds=30.0,
    max_staleness=0,
    is_correction="tis",
    is_cap=2.0,
    generation_devices=0,
    generation_tensor=1,
)

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
CHOICES = dict(
    algo=("grpo", "ppo"),
    loss_type=LOSS_TYPES,
    importance_sampling_level=("token", "sequence"),
    is_correction=("tis", "mis", "none"),
)


@dataclasses.dataclass(frozen=True)
class RlSettings:
    """The loss's settings; no field defaults: the section holds them (`from_config`)."""

    algo: str
    loss_type: str
    importance_sampling_level: str
    temperature: float
    max_new_tokens: int
    beta: float
    eps_low: float
    eps_high: float
    scale_rewards: bool
    adv_eps: float
    gamma: float
    lam: float
    vf_coef: float
    value_clip: float
    whiten: bool
    max_staleness: int
    is_correction: str
    is_cap: float

    @classmethod
    def from_config(cls, r) -> RlSettings:
        return from_section(cls, r)

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0


def check(c) -> None:
    r = c.rl
    for key in (
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "epochs",
        "minibatches",
        "eval_prompts",
        "max_turns",
    ):
        require(r[key] >= 1, f"rl.{key}", r[key], "expected a positive integer")
    require(
        (r.prompts_per_step * r.group_size) % r.minibatches == 0,
        "rl.minibatches",
        r.minibatches,
        f"must divide the {r.prompts_per_step * r.group_size} rollouts of a step (rl.prompts_per_step x rl.group_size)",
    )
    require(
        r.group_size >= 2 or r.algo == "ppo",
        "rl.group_size",
        r.group_size,
        "GRPO compares the responses to one prompt: at least 2",
    )
    for key in ("speculate", "beta", "eps_low", "eps_high", "adv_eps", "vf_coef", "value_clip", "truncation_penalty"):
        require(r[key] >= 0, f"rl.{key}", r[key], "expected >= 0")
    require(
        r.temperature > 0,
        "rl.temperature",
        r.temperature,
        "expected > 0: rollouts are sampled, and the log-probs are taken at this temperature",
    )
    require(0 < r.top_p <= 1, "rl.top_p", r.top_p, "expected a fraction in (0, 1]")
    require(0 <= r.gamma <= 1 and 0 <= r.lam <= 1, "rl.gamma/rl.lam", (r.gamma, r.lam), "expected values in [0, 1]")
    check_rewards(r)
    check_environment(c)


def check_environment(c) -> None:
    r = c.rl
    require(
        0 <= r.max_episode_tokens <= c.data.seq_len,
        "rl.max_episode_tokens",
        r.max_episode_tokens,
        f"expected 0 (data.seq_len) up to data.seq_len={c.data.seq_len}",
    )
    require(r.tool_seconds > 0, "rl.tool_seconds", r.tool_seconds, "expected seconds > 0")
    require(r.max_staleness >= 0, "rl.max_staleness", r.max_staleness, "expected an integer >= 0 (0: synchronous)")
    require(r.generation_devices >= 0, "rl.generation_devices", r.generation_devices, "expected an integer >= 0")
    require(
        r.generation_tensor >= 1 and (r.generation_devices == 0 or r.generation_devices % r.generation_tensor == 0),
        "rl.generation_tensor",
        r.generation_tensor,
        f"expected a positive divisor of rl.generation_devices={r.generation_devices}",
    )
    require(r.is_cap >= 1, "rl.is_cap", r.is_cap, "expected >= 1 (the largest importance weight kept)")
    scored = [k for k in ("rewards", "reward_url", "reward_model") if r[k]]
    require(
        not (r.environment and scored),
        "rl.environment",
        r.environment,
        f"gives the rewards itself; leave rl.{scored[0] if scored else 'rewards'} empty (or wrap the functions in "
        "lm.train.environments.SingleTurn)",
    )


def check_rewards(r) -> None:
    """The endpoint's keys and the failure share."""
    if r.reward_url:
        parts = urllib.parse.urlsplit(r.reward_url)
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:  # a port that is not a number
            port_ok = False
        require(
            parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok,
            "rl.reward_url",
            r.reward_url,
            "expected an http:// or https:// URL (or '' for none)",
        )
    require(r.reward_timeout > 0, "rl.reward_timeout", r.reward_timeout, "expected seconds > 0")
    require(r.reward_retries >= 0, "rl.reward_retries", r.reward_retries, "expected an integer >= 0")
    require(
        0 <= r.max_reward_failures <= 1,
        "rl.max_reward_failures",
        r.max_reward_failures,
        "expected a share in [0, 1] of the rollouts whose reward may fail",
    )
