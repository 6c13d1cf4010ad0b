"""The `reward` section (`lm reward`): a Bradley-Terry reward model on preference pairs (finetune.data)."""

from __future__ import annotations

from lm.config.core import require

# loss -log sigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected)^2
# (keeps scores centred at 0); margin is the pair's "margin" field
DEFAULTS = dict(center_coef=0.0)


def check(c) -> None:
    require(c.reward.center_coef >= 0, "reward.center_coef", c.reward.center_coef, "expected >= 0")
