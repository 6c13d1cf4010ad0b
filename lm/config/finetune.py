"""The `finetune` section: what every stage that starts from a trained model reads (`lm sft`,
`lm dpo`, `lm reward`, `lm rl`, `lm distill`), and how fine-tuning changes other sections' defaults.

A stage whose default differs from the one here declares it on its registry entry
(lm.train.registry StageEntry.defaults); lm.train.finetune applies it before the config file."""

from __future__ import annotations

from lm.config.core import ON_BAD_RECORD, require

TRUNCATION = ("drop", "cut_prompt_left", "cut_response")
TRAIN_ON = ("all", "last")

# init: the run, export or Hugging Face model to start from. data, eval_data: the stage's JSONL
# (conversations, pairs or prompts). epochs > 0 sets train.steps from the data (0: train.steps as
# given; lm rl samples its data instead). truncation of over-long examples: drop |
# cut_prompt_left | cut_response; train_on: all | last assistant turns. A bad record stops the run
# (on_bad_record=error, naming FILE:LINE) or is counted (skip); more than max_skipped_fraction of
# examples skipped (over-long, no loss token) stops it. eval_examples held-out conversations are
# answered greedily at the end, up to eval_max_new_tokens; eval_answers: held-out conversations
# (chat JSONL) answered by the initial and the tuned model at the end ('' = none).
DEFAULTS = dict(
    init="",
    data="",
    eval_data="",
    epochs=1.0,
    truncation="drop",
    train_on="all",
    on_bad_record="error",
    max_skipped_fraction=0.05,
    eval_examples=256,
    eval_max_new_tokens=64,
    eval_answers="",
)

CHOICES = dict(truncation=TRUNCATION, train_on=TRAIN_ON, on_bad_record=ON_BAD_RECORD)

# Other sections' keys as fine-tuning sets them (a config file or overrides may change each): a
# short warmup, decay to 0, no weight decay, and (LR_FRACTION) a tenth of the init run's peak
# learning rate.
OVERRIDES = {
    "optim.warmup_steps": 10,
    "optim.min_lr_ratio": 0.0,
    "optim.weight_decay": 0.0,
    "eval.every_steps": 50,
    "checkpoint.every_steps": 100,
    "train.log_every": 10,
}
LR_FRACTION = 0.1


def check(c) -> None:
    f = c.finetune
    require(f.epochs >= 0, "finetune.epochs", f.epochs, "expected >= 0 (0 = use train.steps)")
    require(
        0.0 <= f.max_skipped_fraction <= 1.0,
        "finetune.max_skipped_fraction",
        f.max_skipped_fraction,
        "expected a fraction in [0, 1]",
    )
    for key in ("eval_examples", "eval_max_new_tokens"):
        require(f[key] >= 1, f"finetune.{key}", f[key], "expected a positive integer")
