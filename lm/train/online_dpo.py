"""`lm online-dpo`: DPO on pairs sampled from the current policy and ranked as they are sampled.

Each step: rl.group_size responses (2 by default, as TRL) to each of rl.prompts_per_step prompts
from the policy through the engine -> rewards (lm rl's: functions and verifiers, a reward model,
an HTTP endpoint) -> per prompt the best response as chosen and the worst as rejected -> one DPO
update on those pairs (lm.train.pair_losses, dpo.loss and dpo.beta; the reference held live as
`lm dpo` holds it, none for simpo and orpo). A prompt whose responses all score the same (or with
fewer than two rewards that did not fail) says nothing about preference: its pair is padding,
which counts nowhere, and `no_preference` logs the share. The sampling key is fold_in(seed, step)
as in `lm rl`, so a killed run resumes exactly.
"""

from __future__ import annotations

import jax
import numpy as np

from lm.config import with_values
from lm.errors import UserError
from lm.model import counts
from lm.model.lora import is_adapter
from lm.train import rl_step
from lm.train.dpo import reference_mode
from lm.train.pair_losses import TEXT_FIELDS, DpoSettings, dpo_loss
from lm.train.pairs import PAIR_EXTRA
from lm.train.reward_failures import RewardFailures, finite_mean
from lm.train.rl import Rl, split_devices
from lm.train.rl_async import Lookahead
from lm.train.rollout import Rollouts
from lm.train.setup import build_run, reference_slot
from lm.train.stage import run_stage


def online_dpo_config(config):
    """The config of an online DPO run: one update per step over rl.prompts_per_step pairs."""
    return with_values(config, {"train.batch_size": config.rl.prompts_per_step})


def build_online_dpo_run(config, devices=None):
    config = online_dpo_config(config)
    lora, mode = config.model.lora_rank > 0, reference_mode(config)
    if mode == "precomputed":
        raise UserError(
            "dpo.reference='precomputed' cannot serve online DPO: its pairs are sampled as it trains; use 'live'"
        )
    live = mode in ("live", "adapters_off")
    return build_run(
        config,
        lambda m: dpo_loss(m, DpoSettings.from_config(config.dpo), "live" if live else "none"),
        devices=split_devices(config, devices)[0],
        trainable=is_adapter if lora else None,
        frozen={"reference": reference_slot(config, lora)} if live else None,
    )


def ranked_pairs(ro: Rollouts, total: np.ndarray, group: int) -> tuple[dict, dict]:
    """([P, 2, T] pair rows: each group's best response (first of equals) then its worst (last of
    equals), padding where the group has no preference; metrics)."""
    rows = {k: ro.rows[k] for k in TEXT_FIELDS}
    p, t = len(total) // group, rows["inputs"].shape[1]
    pairs = {k: np.zeros((p, 2, t), v.dtype) for k, v in rows.items()}
    chosen, rejected, used = [], [], 0
    for g in range(p):
        scores = total[g * group : (g + 1) * group]
        ok = np.flatnonzero(np.isfinite(scores))
        if len(ok) < 2 or scores[ok].max() == scores[ok].min():
            continue
        best = g * group + ok[np.argmax(scores[ok])]
        worst = g * group + ok[len(ok) - 1 - np.argmin(scores[ok][::-1])]
        for side, i in enumerate((best, worst)):
            for k in rows:
                pairs[k][g, side] = rows[k][i]
        chosen.append(total[best]), rejected.append(total[worst])
        used += 1
    pairs["margin"] = np.zeros((p,), np.float32)
    metrics = {
        "pairs_used": float(used),
        "no_preference": 1.0 - used / max(p, 1),
        "reward/chosen_score": finite_mean(np.asarray(chosen)) if chosen else float("nan"),
        "reward/rejected_score": finite_mean(np.asarray(rejected)) if rejected else float("nan"),
    }
    return pairs, metrics


class OnlineDpoStep(rl_step.RlStep):
    """`step(state, prompt batch) -> (state, metrics)`: sample, rank, one DPO update."""

    def __init__(self, run, frozen, prompts, rewards, sampler, template, r):
        self.run, self.frozen, self.prompts, self.rewards = run, frozen, prompts, rewards
        self.sampler, self.template, self.episodes, self.pipeline = sampler, template, None, None
        self.group, self.seed = r.group_size, run.config.train.seed
        self.signature = run.signature(r.prompts_per_step, pairs=True, extra=PAIR_EXTRA)
        self.update = run.bind(run.train_step(self.signature), frozen)
        self.placer = run.placer(self.signature)
        self.failures = RewardFailures(r.max_reward_failures)

    def stream(self, prompt_batches) -> Lookahead:
        """The prompt stream, its checkpointed state holding the failed rewards' count."""
        return Lookahead(prompt_batches, None, self.failures)

    def __call__(self, state, batch):
        step = int(jax.device_get(state.step))
        rollout = self.produce(self.sampler.params(state.params, self.frozen), batch, step)
        failed = self.failures.record(rollout.total, rollout.parts, self.rewards.failable, rollout.errors)
        pairs, ranked = ranked_pairs(rollout.ro, rollout.total, self.group)
        state, stats = self.update(state, self.placer.from_global(pairs))
        out = {k: float(v) for k, v in jax.device_get(stats).items()}
        ro, total = rollout.ro, rollout.total
        out |= (
            failed
            | ranked
            | {
                "reward": finite_mean(total),
                **{f"reward/{k}": finite_mean(v) for k, v in rollout.parts.items()},
                "response_length": float(ro.lengths.mean()),
                "truncated": float(ro.truncated.mean()),
                "rollout_tokens_per_s": float(ro.lengths.sum() / max(rollout.seconds, 1e-9)),
            }
        )
        return state, out


class OnlineDpo(Rl):
    """Prompts in; each step samples, ranks and takes a DPO update (the module doc)."""

    name = "online_dpo"

    def configure(self, ctx):
        return online_dpo_config(ctx.config)

    def build(self, ctx):
        return build_online_dpo_run(ctx.config)

    def batches(self, ctx):
        r, run = ctx.config.rl, ctx.run
        prompts, _, rewards = ctx.data
        if r.environment or r.max_staleness:
            key = "rl.environment" if r.environment else "rl.max_staleness"
            raise UserError(f"{key}: online DPO samples one answer per prompt in turn; leave {key} at its default")
        template, sampler = self.make_sampler(ctx)
        rewards.place(run.mesh)
        self.step = OnlineDpoStep(run, ctx.frozen, prompts, rewards, sampler, template, r)
        return self.step.stream(self.prompt_stream(ctx, prompts)), self.step.signature, self.step

    def flops_per_token(self, ctx):
        # per token of a pair row: the update (6N), a live reference (2N) and sampling (~2N)
        passes = 3 + (reference_mode(ctx.config) in ("live", "adapters_off")) + 1
        return counts.flops_per_token(ctx.config.model, ctx.config.data.seq_len) * passes / 3


def online_dpo(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(OnlineDpo(), config, workdir, resume, show_progress)
