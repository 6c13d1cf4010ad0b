"""The `distill` section (`lm distill`): a student matches a teacher's next-token distributions
(lm.train.distill_losses). The student starts from finetune.init."""

from __future__ import annotations

import math

from lm.config.core import require

# teacher: an `lm train` or `lm sft` run, or an `lm export`, sharing the student's vocabulary.
# divergence: forward_kl (mass-covering) | reverse_kl (mode-seeking) | jsd (beta: the mixture
# weight; 0 is forward_kl, 1 is reverse_kl); both models' logits are divided by temperature first.
# on_policy_fraction: the share of steps (drawn per step from train.seed) whose rows are the
# student's own responses to the data's prompts, sampled at `temperature` up to max_new_tokens,
# instead of the data's responses (GKD's lambda; 0 = off-policy only)
DEFAULTS = dict(
    teacher="", divergence="forward_kl", beta=0.5, temperature=1.0, on_policy_fraction=0.0, max_new_tokens=64
)

CHOICES = dict(divergence=("forward_kl", "reverse_kl", "jsd"))


def check(c) -> None:
    d = c.distill
    require(0.0 <= d.beta <= 1.0, "distill.beta", d.beta, "expected a weight in [0, 1]")  # NaN fails too
    require(0.0 < d.temperature < math.inf, "distill.temperature", d.temperature, "expected a finite number > 0")
    require(
        0.0 <= d.on_policy_fraction <= 1.0,
        "distill.on_policy_fraction",
        d.on_policy_fraction,
        "expected a fraction in [0, 1]",
    )
    require(d.max_new_tokens >= 1, "distill.max_new_tokens", d.max_new_tokens, "expected a positive integer")
    require(
        d.on_policy_fraction == 0 or d.max_new_tokens < c.data.seq_len,
        "distill.max_new_tokens",
        d.max_new_tokens,
        f"must leave room for a prompt in data.seq_len={c.data.seq_len}",
    )
