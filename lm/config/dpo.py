"""The `dpo` section (`lm dpo`), and `DpoSettings`, the loss's frozen form (lm.train.pair_losses)."""

from __future__ import annotations

import dataclasses

from lm.config.core import from_section, require

# loss sigmoid (DPO; label_smoothing > 0: conservative DPO) | ipo | simpo (no reference,
# length-normalised, margin simpo_gamma); rpo_alpha: weight of an NLL term on the chosen response;
# reference: live (the init model runs beside the policy, frozen, in the compute dtype; with LoRA:
# the base with adapters off) | precomputed (its log-probs, computed once before training)
DEFAULTS = dict(loss="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, rpo_alpha=0.0, reference="live")

CHOICES = dict(loss=("sigmoid", "ipo", "simpo"), reference=("live", "precomputed"))


@dataclasses.dataclass(frozen=True)
class DpoSettings:
    """No field defaults: the section holds them (`from_config`)."""

    loss: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    rpo_alpha: float

    @classmethod
    def from_config(cls, d) -> DpoSettings:
        return from_section(cls, d)

    @property
    def needs_reference(self) -> bool:
        return self.loss != "simpo"


def check(c) -> None:
    d = c.dpo
    require(d.beta > 0, "dpo.beta", d.beta, "expected > 0")
    require(0.0 <= d.label_smoothing < 0.5, "dpo.label_smoothing", d.label_smoothing,
            "expected a fraction in [0, 0.5)")
    require(d.label_smoothing == 0.0 or d.loss == "sigmoid", "dpo.label_smoothing",
            d.label_smoothing, f"applies to dpo.loss='sigmoid' only (dpo.loss is '{d.loss}')")
    for key in ("rpo_alpha", "simpo_gamma"):
        require(d[key] >= 0, f"dpo.{key}", d[key], "expected >= 0")
