"""The `distill` section (`lm distill`): a student matches a teacher's next-token distributions
(lm.train.distill_losses). The student starts from sft.init."""

from __future__ import annotations

import math

from lm.config.core import require

# teacher: an `lm train` or `lm sft` run, or an `lm export`, sharing the student's vocabulary.
# divergence: forward_kl (mass-covering) | reverse_kl (mode-seeking) | jsd (beta: the mixture
# weight; 0 is forward_kl, 1 is reverse_kl); both models' logits are divided by temperature first
DEFAULTS = dict(teacher="", divergence="forward_kl", beta=0.5, temperature=1.0)

CHOICES = dict(divergence=("forward_kl", "reverse_kl", "jsd"))


def check(c) -> None:
    d = c.distill
    require(0.0 <= d.beta <= 1.0, "distill.beta", d.beta, "expected a weight in [0, 1]")  # NaN fails too
    require(0.0 < d.temperature < math.inf, "distill.temperature", d.temperature, "expected a finite number > 0")
