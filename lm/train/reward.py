"""`lm reward`: a Bradley-Terry reward model from a trained model on preference pairs.

The model is the init model's trunk with a scalar head (lm.model.heads.ScalarHead, zero at
the start, so every pair starts at a margin of 0); a sequence's reward is the head's value at
its last real token (the response's end marker). The loss is lm.train.pair_losses.reward_loss:
-log sigmoid(r_chosen - r_rejected - margin) plus an optional centring term. With LoRA the
adapters and the head train. The run's checkpoints hold the head beside the trunk, so
`lm reward score` and RL load the result as a scorer (lm.infer.score).
"""

from __future__ import annotations

from lm.model.build import reward_model
from lm.model.lora import is_adapter_or_head
from lm.train import pairs
from lm.train.pair_losses import reward_loss
from lm.train.setup import build_run
from lm.train.stage import first_eval, run_stage

EVAL_METRICS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


def build_reward_run(config, devices=None):
    lora = config.model.lora_rank > 0
    return build_run(
        config,
        lambda m: reward_loss(m, config.reward.center_coef),
        devices=devices,
        model_fn=reward_model,
        trainable=is_adapter_or_head if lora else None,
    )


class Reward(pairs.PairStage):
    name = "reward"
    eval_metrics = EVAL_METRICS

    def build(self, ctx):
        return build_reward_run(ctx.config)

    def finish(self, ctx) -> dict:
        c, last = ctx.config, ctx.last
        before, after = first_eval(ctx.workdir), {k: v for k, v in last.items() if k.startswith("eval_")}
        summary = {
            "step": c.train.steps,
            "init": c.finetune.init,
            "lora_rank": c.model.lora_rank,
            "data": ctx.data[0].stats,
            "eval_init": before,
            "eval": after,
            "loss": last.get("loss"),
            "run_tokens_per_s": last.get("run_tokens_per_s"),
        }
        if ctx.data[1] is not None:
            print(
                pairs.eval_table(
                    "reward model: held-out pairs",
                    ("loss", "accuracy", "margin"),
                    before,
                    after,
                    self.held_out_pairs(ctx),
                )
            )
        return summary


def reward(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Reward(), config, workdir, resume, show_progress)
