"""The `kto` section (`lm kto`), and `KtoSettings`, the loss's frozen form (lm.train.kto)."""

from __future__ import annotations

import dataclasses

from lm.config.core import from_section, require

# KTO (Ethayarajh et al. 2024) on unpaired examples {"prompt", "completion", "label": true|false}:
# beta scales the implied rewards; desirable_weight / undesirable_weight weigh the examples
# labelled true / false (TRL advises their weighted counts within 1:1 and 4:3); reference: live
# (the init model runs beside the policy; with LoRA: the base with adapters off) | precomputed
# (its log-probs, computed once before training)
DEFAULTS = dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, reference="live")

CHOICES = dict(reference=("live", "precomputed"))


@dataclasses.dataclass(frozen=True)
class KtoSettings:
    """No field defaults: the section holds them (`from_config`)."""

    beta: float
    desirable_weight: float
    undesirable_weight: float

    @classmethod
    def from_config(cls, k) -> KtoSettings:
        return from_section(cls, k)


def check(c) -> None:
    k = c.kto
    require(k.beta > 0, "kto.beta", k.beta, "expected > 0")
    for key in ("desirable_weight", "undesirable_weight"):
        require(k[key] > 0, f"kto.{key}", k[key], "expected > 0")
