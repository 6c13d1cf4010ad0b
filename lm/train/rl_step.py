"""One RL step: rollouts with the KV-cache sampler, rewards, advantages, then the updates.

    prompts (P per step) -> G responses each (sampled on the run's mesh) -> rewards (Python
    functions, a reward model, a truncation penalty) -> the scoring pass (reference log-probs,
    PPO's values; the old log-probs at a sampling temperature other than 1) -> advantages
    (GRPO: group-relative; PPO: GAE over KL-shaped per-token rewards) -> `epochs` passes over
    the P*G rows in `minibatches` jitted updates (the shared update routine, lm.train.steps,
    with rl_loss)

The step's sampling key is fold_in(seed, step), and the minibatch order a permutation drawn
from it, so a resumed run repeats exactly what the killed one would have done.

With rl.environment the rollouts are multi-turn episodes whose environment gives the rewards
(lm.train.episodes); with rl.max_staleness > 0 they are sampled ahead by older params on a
worker thread (lm.train.rl_async) and the update weighs them by pi_current / pi_sampler.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from lm.infer.sampling import SamplingParams
from lm.train.reward_failures import RewardFailures, failed_rows, finite_mean, source_failures
from lm.train.rl_async import Lookahead, Pipeline, Rollout
from lm.train.rl_losses import RlSettings, gae, group_advantages, whiten
from lm.train.rollout import Rollouts, layout

UPDATE_METRICS = ("loss", "grad_norm", "lr")
# per-token statistics: totals over each update's response tokens (lm.train.rl_losses), reported as means
TOKEN_METRICS = ("policy_loss", "kl", "clip_fraction", "ratio", "entropy", "value_loss", "value_clip_fraction")


def extra_fields(settings: RlSettings) -> dict:
    """Per-token fields of the update rows beyond the text contract: {name: dtype}."""
    names = ["old_logp", "advantages"] + (["is_weight"] if settings.max_staleness else [])
    if settings.algo == "ppo":
        names += ["old_values", "returns"]
    elif settings.needs_reference:
        names += ["ref_logp"]
    return {n: np.float32 for n in names}


def advantages(settings: RlSettings, ro: Rollouts, rewards: np.ndarray, scored: dict, group: int) -> tuple[dict, dict]:
    """(per-token fields for the update, metrics) of scored rollouts. A row whose reward is NaN
    (failed) must have its loss mask already zero: GRPO leaves it out of its group's statistics."""
    mask = ro.rows["loss_mask"]
    if settings.algo == "grpo":
        adv = group_advantages(rewards, group, settings.scale_rewards, settings.adv_eps)
        return {"advantages": adv[:, None] * mask} | scored, {}
    kl = np.where(mask > 0, ro.rows["old_logp"] - scored["ref_logp"], 0.0) if "ref_logp" in scored else 0.0 * mask
    token_rewards = -settings.beta * kl
    last = np.maximum(mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1), 0)
    token_rewards[np.arange(len(rewards)), last] += np.where(np.isfinite(rewards), rewards, 0.0)  # NaN: masked out
    values = scored["old_values"]
    adv, returns = gae(token_rewards, values, mask, settings.gamma, settings.lam)
    if settings.whiten:
        adv = whiten(adv, mask)
    m = mask > 0
    var = returns[m].var() if m.any() else 0.0
    explained = float(1.0 - (returns[m] - values[m]).var() / var) if var > 0 else 0.0
    fields = {"advantages": adv, "returns": returns, "old_values": values}
    return fields, {
        "kl": float(kl[m].mean()) if m.any() else 0.0,
        "explained_variance": explained,
        "value_mean": float(values[m].mean()) if m.any() else 0.0,
    }


class RlStep:
    """`step(state, prompt batch) -> (state, metrics)` for lm.train.fit (see the module doc)."""

    def __init__(
        self, run, frozen, prompts, rewards, sampler, scorer, template, settings: RlSettings, r, episodes=None
    ):
        self.run, self.frozen, self.prompts, self.rewards = run, frozen, prompts, rewards
        self.episodes = episodes  # lm.train.episodes.EpisodeRollouts (rl.environment), else one answer per prompt
        self.sampler, self.scorer, self.template, self.settings = sampler, scorer, template, settings
        self.group, self.epochs, self.minibatches = r.group_size, r.epochs, r.minibatches
        self.seed = run.config.train.seed
        rows, t = r.prompts_per_step * r.group_size, run.config.data.seq_len
        fields = extra_fields(settings)
        self.signature = run.signature(rows // r.minibatches, extra={k: ((t,), dt) for k, dt in fields.items()})
        self.update = run.bind(run.train_step(self.signature), frozen)
        self.placer = run.placer(self.signature)
        self.score_placer = run.placer(run.signature(rows))
        self.failures = RewardFailures(r.max_reward_failures)
        self.pipeline = None  # rl.max_staleness > 0: rollouts sampled ahead (`pipelined`)

    def stream(self, prompt_batches) -> Lookahead:
        """The prompt stream the loop reads: its checkpointed state holds the failed rewards'
        count and, with rl.max_staleness > 0, the rollouts sampled ahead (lm.train.rl_async)."""
        k = self.settings.max_staleness
        self.pipeline = Pipeline(self.produce, k, self.sampler.snapshot) if k else None
        return Lookahead(prompt_batches, self.pipeline, self.failures)

    def __call__(self, state, batch):
        t_start = time.perf_counter()
        step = int(jax.device_get(state.step)) // self.run.updates_per_step
        rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), step)
        params = self.sampler.params(state.params, self.frozen)
        if self.pipeline is not None:  # sampled ahead, by the params of step - rl.max_staleness at the oldest
            t0 = time.perf_counter()
            rollout = self.pipeline.take(step, batch, params)
            waited = time.perf_counter() - t0
        else:
            rollout = self.produce(params, batch, step)
        ro, total = rollout.ro, rollout.total
        scored = self.scorer(state.params, self.frozen, ro.rows, self.score_placer)
        extra = dict(rollout.counts)
        if self.episodes is None:  # counted as trained (not as sampled ahead): a checkpoint holds the count
            extra |= self.failures.record(total, rollout.parts, self.rewards.failable, rollout.errors)
        if self.pipeline is not None:  # this policy is the proximal one; the sampler's is older
            ro.rows["is_weight"], weights = importance_weights(self.settings, ro.rows, scored["old_logp"])
            extra |= weights | {"staleness": float(step - rollout.version), "rollout_wait_s": waited}
        if "old_logp" in scored:  # at a temperature other than 1: the policy's own pass, not the sampler's
            ro.rows["old_logp"] = scored.pop("old_logp")
        fields, more = advantages(self.settings, ro, total, scored, self.group)
        rows = ro.rows | fields
        t1 = time.perf_counter()
        state, updates = self._updates(state, rows, rng)
        t_update = time.perf_counter() - t1
        if self.pipeline is not None:  # the learner's share of the step spent waiting for rollouts
            extra["rollout_wait_share"] = waited / max(time.perf_counter() - t_start, 1e-9)
        return state, self._metrics(ro, total, rollout.parts, updates, extra | more, rollout.seconds, t_update)

    def produce(self, params, batch, step: int) -> Rollout:
        """The scored rollouts of one step's prompt batch, sampled with `params` (the policy's)."""
        rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), step)
        index = [int(i) for i in np.asarray(batch["index"]) for _ in range(self.group)]
        t0 = time.perf_counter()
        if self.episodes is not None:  # multi-turn: the environment's steps give the rewards
            ro, total, parts, counts = self.episodes(params, [self.prompts.example(i) for i in index], rng)
            ro = self._behaviour(params, ro)
            return Rollout(ro, total, parts, counts, time.perf_counter() - t0, step)
        prompt_ids = [self.prompts.tokens(i) for i in index]
        generation = self.sampler(params, prompt_ids, rng)
        seconds = time.perf_counter() - t0
        ro = self._behaviour(params, layout(prompt_ids, generation, self.run.config.data.seq_len))
        completions = [self.template.answer_text(ids) for ids in ro.responses]
        total, parts = self.rewards(
            [self.prompts.prompts[i] for i in index],
            [self.prompts.messages[i] for i in index],
            completions,
            ro.truncated,
            [self.prompts.columns[i] for i in index],
        )
        ro.rows["loss_mask"] = ro.rows["loss_mask"] * ~failed_rows(total)[:, None]  # failed rewards: no update
        return Rollout(ro, total, parts, {}, seconds, step, errors=dict(self.rewards.errors))

    def _behaviour(self, params, ro: Rollouts) -> Rollouts:
        """Sampled ahead at an rl.temperature other than 1: the sampler's log-probs at that
        temperature (the importance weights' denominator; the engine reports untempered ones)."""
        if self.pipeline is not None and self.settings.temperature != 1.0:
            ro.rows["old_logp"] = self.sampler.logprobs(params, ro.rows, self.settings.temperature)
        return ro

    def _updates(self, state, rows: dict, rng):
        n = len(rows["inputs"])
        size = n // self.minibatches
        order = np.asarray(jax.random.fold_in(rng, 1)[-1])  # a plain seed for numpy
        perm_rng = np.random.default_rng(int(order))
        names = list(self.signature)
        metrics = []
        for _ in range(self.epochs):
            perm = perm_rng.permutation(n) if self.minibatches > 1 else np.arange(n)
            for m in range(self.minibatches):
                idx = perm[m * size : (m + 1) * size]
                mb = self.placer.from_global({k: rows[k][idx] for k in names})
                state, stats = self.update(state, mb)
                metrics.append(stats)
        return state, jax.device_get(metrics)

    def _metrics(self, ro: Rollouts, total, parts, updates: list, extra: dict, t_sample, t_update) -> dict:
        out = {k: float(np.mean([u[k] for u in updates])) for k in UPDATE_METRICS if k in updates[0]}
        out |= {
            k: float(np.mean([u[k] / max(float(u["tokens"]), 1.0) for u in updates]))
            for k in TOKEN_METRICS
            if k in updates[0]
        }
        out["update_skipped"] = float(sum(u["update_skipped"] for u in updates))
        out |= extra
        ok = np.isfinite(total)
        out |= {
            "reward": finite_mean(total),
            "reward_std": float(total[ok].std()) if ok.any() else float("nan"),
            "zero_std_groups": zero_std_share(total, self.group),
            **{f"reward/{k}": finite_mean(v) for k, v in parts.items()},
            "response_length": float(ro.lengths.mean()),
            "truncated": float(ro.truncated.mean()),
            "rollout_tokens_per_s": float(ro.lengths.sum() / max(t_sample, 1e-9)),
            "update_tokens_per_s": float(
                len(updates)
                * self.signature["inputs"].shape[0]
                * self.signature["inputs"].shape[1]
                / max(t_update, 1e-9)
            ),
            "sampling_share": float(t_sample / max(t_sample + t_update, 1e-9)),
        }
        return out


def importance_weights(settings: RlSettings, rows: dict, current_logp: np.ndarray) -> tuple[np.ndarray, dict]:
    """(per-token weights pi_current / pi_sampler of stale rollouts, their metrics): truncated at
    rl.is_cap (tis), tokens past it left out (mis), or 1 (none)."""
    mask = rows["loss_mask"] > 0
    w = np.exp(np.clip(current_logp - rows["old_logp"], -30.0, 30.0)) * mask
    past = (w > settings.is_cap) & mask
    if settings.is_correction == "tis":
        kept = np.minimum(w, settings.is_cap)
    elif settings.is_correction == "mis":
        kept = np.where(past, 0.0, w)
    else:
        kept = mask.astype(np.float64)
    n = max(int(mask.sum()), 1)
    metrics = {
        "is_weight_mean": float(w.sum() / n),
        "is_weight_max": float(w.max()) if mask.any() else 0.0,
        "is_capped_fraction": float(past.sum() / n),
    }
    return kept.astype(np.float32), metrics


def zero_std_share(total: np.ndarray, group: int) -> float:
    """The share of groups with no signal: all their rewards equal, or fewer than 2 that did not fail."""
    groups = total.reshape(-1, group)
    flat = [g[np.isfinite(g)] for g in groups]
    return float(np.mean([len(g) < 2 or g.std() == 0 for g in flat]))


def greedy(sampling: SamplingParams) -> SamplingParams:
    return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=0.0)


def evaluator(step: RlStep, prompts, limit: int, batch_size: int):
    """state -> held-out rewards of greedy responses to the first `limit` eval prompts."""
    n = min(limit, len(prompts))
    sampling = greedy(step.sampler.sampling)

    def evaluate(state):
        params = step.sampler.params(state.params, step.frozen)
        if step.episodes is not None:
            return _evaluate_episodes(step, params, prompts, n, batch_size, sampling)
        totals, parts_all, lengths, truncated = [], {}, [], []
        for s in range(0, n, batch_size):
            idx = list(range(s, min(s + batch_size, n)))
            gen = step.sampler(params, [prompts.tokens(i) for i in idx], jax.random.PRNGKey(0), sampling)
            texts = [step.template.answer_text(ids) for ids in gen.ids]
            cut = np.array([f == "length" for f in gen.finish])
            total, parts = step.rewards(
                [prompts.prompts[i] for i in idx],
                [prompts.messages[i] for i in idx],
                texts,
                cut,
                [prompts.columns[i] for i in idx],
            )
            totals.append(total), lengths.append([len(x) for x in gen.ids]), truncated.append(cut)
            for k, v in parts.items():
                parts_all.setdefault(k, []).append(v)
        parts_all = {k: np.concatenate(v) for k, v in parts_all.items()}
        out = {
            "eval_reward": finite_mean(np.concatenate(totals)),  # over the answers whose rewards did not fail
            "eval_reward_failed": float(failed_rows(np.concatenate(totals)).sum()),
            "eval_response_length": float(np.concatenate(lengths).mean()),
            "eval_truncated": float(np.concatenate(truncated).mean()),
        }
        out |= source_failures(parts_all, step.rewards.failable, prefix="eval_reward")
        return out | {f"eval_reward/{k}": finite_mean(v) for k, v in parts_all.items()}

    return evaluate


def _evaluate_episodes(step: RlStep, params, prompts, n: int, batch_size: int, sampling) -> dict:
    """Held-out greedy episodes: their mean reward and terms, lengths and how they ended."""
    totals, parts_all, lengths, metrics = [], {}, [], []
    for s in range(0, n, batch_size):
        examples = [prompts.example(i) for i in range(s, min(s + batch_size, n))]
        ro, total, parts, counts = step.episodes(params, examples, jax.random.PRNGKey(0), sampling)
        totals.append(total), lengths.append(ro.lengths), metrics.append((len(examples), counts))
        for k, v in parts.items():
            parts_all.setdefault(k, []).append(v)
    out = {
        "eval_reward": float(np.concatenate(totals).mean()),
        "eval_response_length": float(np.concatenate(lengths).mean()),
    }
    out |= {f"eval_reward/{k}": float(np.concatenate(v).mean()) for k, v in parts_all.items()}
    weight = sum(m for m, _ in metrics)
    return out | {f"eval_{k}": sum(m * c[k] for m, c in metrics) / weight for k in metrics[0][1]}
