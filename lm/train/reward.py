"""`lm reward`: a Bradley-Terry reward model from a trained model on preference pairs.

The model is the init model's trunk with a scalar head (lm.model.heads.ScalarHead, zero at
the start, so every pair starts at a margin of 0); a sequence's reward is the head's value at
its last real token (the response's end marker). The loss is lm.train.pair_losses.reward_loss:
-log sigmoid(r_chosen - r_rejected - margin) plus an optional centring term. With LoRA the
adapters and the head train. The run's checkpoints hold the head beside the trunk, so
`lm reward score` and RL load the result as a scorer (lm.infer.score).
"""

from __future__ import annotations

import functools
import json

import jax

from lm.model.lora import is_adapter
from lm.model.transformer import Transformer
from lm.train import pairs
from lm.train.metrics import plot_curves
from lm.train.pair_losses import reward_loss
from lm.train.setup import build_run

EVAL_METRICS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")
reward_model = functools.partial(Transformer, scalar_head=True)


def head_or_adapter(path) -> bool:
    """With LoRA, what trains: the adapters and the scalar head."""
    return is_adapter(path) or getattr(path[0], "key", path[0]) == "scalar_head"


def build_reward_run(config, devices=None):
    lora = config.model.lora_rank > 0
    return build_run(config, lambda m: reward_loss(m, config.reward.center_coef), devices=devices,
                     model_fn=reward_model, trainable=head_or_adapter if lora else None)


def reward(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    stage = pairs.prepare(config, workdir, resume, "reward")
    if isinstance(stage, dict):
        return stage
    run = build_reward_run(config)
    _, _, last = pairs.train(stage, run, resume=resume, show_progress=show_progress, eval_metrics=EVAL_METRICS)
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"]}
    before, after = pairs.first_eval(stage.workdir), {k: v for k, v in last.items() if k.startswith("eval_")}
    summary = {"step": config.train.steps, "init": config.pairs.init, "lora_rank": config.model.lora_rank,
               "data": stage.train.stats, "eval_init": before, "eval": after,
               "loss": last.get("loss"), "run_tokens_per_s": last.get("run_tokens_per_s")}
    if stage.heldout is not None:
        n = min(config.pairs.eval_pairs, len(stage.heldout))
        print(pairs.eval_table("reward model: held-out pairs", ("loss", "accuracy", "margin"), before, after, n))
    if jax.process_index() == 0:
        plot_curves(stage.workdir / "metrics.jsonl", stage.workdir / "loss.png")
        (stage.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
