"""`lm kto`: Kahneman-Tversky optimisation (Ethayarajh et al. 2024) from a trained model on
unpaired examples, each a completion labelled desirable or not (lm.data.unpaired).

With r = log pi(y|x) - log ref(y|x) (summed over the completion) and z0 the batch's KL estimate,
TRL's loss per example is

  desirable    w_d (1 - sigmoid(beta (r - z0)))
  undesirable  w_u (1 - sigmoid(beta (z0 - r)))

averaged over the batch's examples. z0 = max(0, mean over the batch of log pi(y'|x) - log ref(y'|x))
for mismatched pairs (each prompt with another example's completion, lm.data.unpaired), with no
gradient, as TRL computes it. The reference is held as in `lm dpo` (kto.reference: live, or
precomputed once before training; with LoRA the base with adapters off). Metrics carry TRL's
names: kl, rewards/chosen and logps/chosen (means over the desirable examples of the batch),
rewards/rejected, logps/rejected, count/chosen, count/rejected; held-out too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import with_values
from lm.config.kto import KtoSettings
from lm.data.cache import data_cache_dir
from lm.data.unpaired import describe, prepare_unpaired
from lm.eval.answers import compare_answers
from lm.model.apply import add_aux, sequence_logprobs
from lm.model.lora import is_adapter
from lm.model.pipeline_1f1b import pipelined_loss, runs_loss
from lm.train import pairs
from lm.train.dpo import Dpo
from lm.train.pair_losses import flat_pairs, pair_logprobs, reference_logps
from lm.train.setup import build_run, reference_slot
from lm.train.stage import first_eval, require_data, run_stage

LABEL = {"label": ((), np.float32)}
EVAL_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
TABLE_KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins")


def kto_terms(s: KtoSettings, logp, ref, kl, desirable):
    """Per example: (loss [B], reward [B]) from summed completion log-probs [B] of the policy and
    the reference, the KL estimate (a scalar) and the labels [B] (bool)."""
    ratio = logp - ref
    loss = jnp.where(
        desirable,
        s.desirable_weight * (1.0 - jax.nn.sigmoid(s.beta * (ratio - kl))),
        s.undesirable_weight * (1.0 - jax.nn.sigmoid(s.beta * (kl - ratio))),
    )
    return loss, s.beta * ratio


def kl_estimate(logp, ref, valid):
    """max(0, mean over the valid mismatched pairs of log pi - log ref), without gradient."""
    n = jnp.maximum(jnp.sum(valid), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(jnp.sum(jnp.where(valid, logp - ref, 0.0)) / n, 0.0))


def kto_loss(model, settings: KtoSettings, reference: str = "live"):
    """LossFn of KTO over [B, 2, T] rows (the example, its mismatched twin) with `label` [B];
    reference: 'live' (frozen['reference']) or 'precomputed' (batch['ref_logps'] [B, 2]). Under
    a 1F1B pipeline the pairs run inside it (as DPO's: lm.train.pair_losses), and the KL estimate
    is each pipeline micro-batch's, as it is each `train.micro_batches` split's."""

    def objective(logp, count, ref, label):
        valid, twin = count[:, 0] > 0, (count[:, 1] > 0) & (count[:, 0] > 0)
        kl = kl_estimate(logp[:, 1], ref[:, 1], twin)
        desirable = label > 0.5
        loss, rewards = kto_terms(settings, logp[:, 0], ref[:, 0], kl, desirable)
        stats = {"loss_sum": jnp.sum(jnp.where(valid, loss, 0.0)), "count": jnp.sum(valid.astype(jnp.float32))}
        for name, side in (("chosen", desirable & valid), ("rejected", ~desirable & valid)):
            n = jnp.sum(side.astype(jnp.float32))
            for metric, x in (("rewards", rewards), ("logps", logp[:, 0])):
                stats |= {f"{metric}/{name}_sum": jnp.sum(jnp.where(side, x, 0.0)), f"{metric}/{name}_count": n}
            stats[f"count/{name}_total"] = n
        stats["kl_sum"] = kl * stats["count"]  # the estimate as a mean over the examples' count
        tokens = jnp.sum(jnp.where(valid, count[:, 0], 0.0))
        return stats["loss_sum"], stats | {"pairs_total": stats["count"], "tokens_total": tokens}

    def head(logits, rows):
        logp, count = sequence_logprobs(logits, rows["targets"], rows["loss_mask"])
        pair = lambda a: a.reshape(-1, 2)  # noqa: E731
        return objective(pair(logp), pair(count), pair(rows["ref_logps"]), pair(rows["label"])[:, 0])

    ref_logps = functools.partial(reference_logps, reference)

    def loss_fn(params, batch, frozen, rng):
        if runs_loss(model):
            rows = flat_pairs(batch) | {
                "ref_logps": ref_logps(frozen, batch).reshape(-1),
                "label": jnp.repeat(jnp.asarray(batch["label"], jnp.float32), 2),
            }
            return pipelined_loss(model, params, rows, rng, head, group=2)
        logp, count, aux = pair_logprobs(model, params, batch, rng)
        return add_aux(model, *objective(logp, count, ref_logps(frozen, batch), batch["label"]), aux)

    return loss_fn


def reference_mode(config) -> str:
    """live | adapters_off | precomputed (as lm.train.dpo's)."""
    if config.kto.reference == "precomputed":
        return "precomputed"
    return "adapters_off" if config.model.lora_rank > 0 else "live"


def build_kto_run(config, devices=None):
    lora, mode = config.model.lora_rank > 0, reference_mode(config)
    settings = KtoSettings.from_config(config.kto)
    live = mode != "precomputed"
    return build_run(
        config,
        lambda m: kto_loss(m, settings, "live" if live else mode),
        devices=devices,
        trainable=is_adapter if lora else None,
        frozen={"reference": reference_slot(config, lora)} if live else None,
    )


def compiled_step(config, devices, spec):
    """The step `lm plan` compiles: KTO with a live reference (the run's own spec)."""
    run = build_kto_run(with_values(config, {"kto.reference": "live"}), devices)
    return run, run.signature(pairs=True, extra=LABEL)


class Kto(Dpo):
    """Unpaired examples in (each with its mismatched twin as a pair); the reference as in DPO."""

    name = "kto"
    eval_metrics = EVAL_METRICS
    row_fields = LABEL

    def check(self, config) -> None:
        require_data(
            config.finetune.data,
            "finetune.data",
            'give `lm kto --data examples.jsonl` ({"prompt", "completion", "label": true|false} lines)',
        )

    def read(self, ctx):
        p, tok, k = ctx.config.finetune, ctx.init.tokenizer, ctx.config.kto
        cache = data_cache_dir(ctx.config.data)
        train = prepare_unpaired(p.data, tok, pairs.settings(ctx.config), cache)
        print(f"kto data {p.data}: {describe(train.stats)}")
        good, bad = train.stats["desirable"], train.stats["undesirable"]
        ratio = (k.desirable_weight * good) / max(k.undesirable_weight * bad, 1e-9)
        if bad and not 1.0 <= ratio <= 4.0 / 3.0:
            print(
                f"kto: desirable_weight x desirable / undesirable_weight x undesirable = {ratio:.2f}; the KTO "
                "paper advises 1 to 4/3 (set kto.desirable_weight / kto.undesirable_weight)"
            )
        heldout = prepare_unpaired(p.eval_data, tok, pairs.settings(ctx.config), cache) if p.eval_data else None
        return train, heldout

    def build(self, ctx):
        return build_kto_run(ctx.config)

    def reference_mode(self, config) -> str:
        return reference_mode(config)

    def finish(self, ctx) -> dict:
        c, last = ctx.config, ctx.last
        before, after = first_eval(ctx.workdir), {k: v for k, v in last.items() if k.startswith("eval_")}
        for row in (before, after):
            if "eval_rewards/chosen" in row:
                row["eval_rewards/margins"] = row["eval_rewards/chosen"] - row["eval_rewards/rejected"]
        summary = {
            "step": c.train.steps,
            "init": c.finetune.init,
            "beta": c.kto.beta,
            "reference": reference_mode(c),
            "lora_rank": c.model.lora_rank,
            "data": ctx.data[0].stats,
            "eval_init": before,
            "eval": after,
        } | {k: last.get(k) for k in ("loss", "kl", "tokens_per_s", "run_tokens_per_s", "compile_s")}
        if before or after:
            print(pairs.eval_table("KTO", TABLE_KEYS, before, after, self.held_out_pairs(ctx), "examples"))
        p = c.finetune
        if p.eval_answers:
            summary |= compare_answers(ctx.init, c, ctx.params, p.eval_answers, p.eval_examples, p.eval_max_new_tokens)
        return summary


def kto(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Kto(), config, workdir, resume, show_progress)
