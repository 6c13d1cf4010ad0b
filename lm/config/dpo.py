"""The `dpo` section (`lm dpo`), and `DpoSettings`, the loss's frozen form (lm.train.pair_losses)."""

from __future__ import annotations

import dataclasses

from lm.config.core import from_section, require

# loss sigmoid (DPO; label_smoothing > 0: conservative DPO) | ipo | simpo (no reference,
# length-normalised, margin simpo_gamma) | orpo (no reference: the chosen NLL plus beta times the
# odds-ratio term; start from a base model, no SFT first); beta 0: the loss's own default (LOSS_BETA);
# rpo_alpha: weight of an NLL term on the chosen response, averaged per chosen response
# (rpo_nll=per_response, the RPO paper's) or over the chosen tokens of the batch (per_token,
# TRL's); reference: live (the init model runs beside the policy, frozen, in the compute dtype;
# with LoRA: the base with adapters off) | precomputed (its log-probs, computed once before training)
DEFAULTS = dict(
    loss="sigmoid",
    beta=0.0,
    label_smoothing=0.0,
    simpo_gamma=1.0,
    rpo_alpha=0.0,
    rpo_nll="per_response",
    reference="live",
)

# each loss's beta when dpo.beta is 0: TRL's 0.1 for DPO, IPO and ORPO (its lambda); SimPO's
# authors' 2.0 (with simpo_gamma 1.0: their gamma / beta ratio of 0.5)
LOSS_BETA = dict(sigmoid=0.1, ipo=0.1, simpo=2.0, orpo=0.1)

CHOICES = dict(loss=tuple(LOSS_BETA), rpo_nll=("per_response", "per_token"), reference=("live", "precomputed"))


@dataclasses.dataclass(frozen=True)
class DpoSettings:
    """No field defaults: the section holds them (`from_config`)."""

    loss: str
    beta: float  # as in the section: 0 is the loss's default, see `loss_beta`
    label_smoothing: float
    simpo_gamma: float
    rpo_alpha: float
    rpo_nll: str

    @classmethod
    def from_config(cls, d) -> DpoSettings:
        return from_section(cls, d)

    @property
    def loss_beta(self) -> float:
        """The beta the loss uses: dpo.beta, or the loss's default when it is 0."""
        return self.beta or LOSS_BETA[self.loss]

    @property
    def needs_reference(self) -> bool:
        return self.loss not in ("simpo", "orpo")


def check(c) -> None:
    d = c.dpo
    require(
        d.beta >= 0,
        "dpo.beta",
        d.beta,
        f"expected > 0, or 0 for the loss's default ({', '.join(f'{k} {v:g}' for k, v in LOSS_BETA.items())})",
    )
    require(0.0 <= d.label_smoothing < 0.5, "dpo.label_smoothing", d.label_smoothing, "expected a fraction in [0, 0.5)")
    require(
        d.label_smoothing == 0.0 or d.loss == "sigmoid",
        "dpo.label_smoothing",
        d.label_smoothing,
        f"applies to dpo.loss='sigmoid' only (dpo.loss is '{d.loss}')",
    )
    require(
        d.rpo_alpha == 0.0 or d.loss != "orpo",
        "dpo.rpo_alpha",
        d.rpo_alpha,
        "must be 0 with dpo.loss='orpo' (ORPO's NLL term is its own)",
    )
    for key in ("rpo_alpha", "simpo_gamma"):
        require(d[key] >= 0, f"dpo.{key}", d[key], "expected >= 0")
