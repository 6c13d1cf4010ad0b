"""Rollouts whose reward failed: counted, reported, and a stop once there are too many.

A failed reward is NaN (lm.train.rewards); its row leaves the update (lm.train.rl_step). The
count runs from the start of the run (a checkpoint holds it, with the prompt stream's state);
the run stops with one line naming the sources and why they failed once the failed rollouts
pass `rl.max_reward_failures` of those scored. 0 stops at the first failure.
"""

from __future__ import annotations

import numpy as np

from lm.errors import UserError


def failed_rows(total: np.ndarray) -> np.ndarray:
    """[N] bool: the rows left out of the update (a reward of weight other than 0 failed)."""
    return ~np.isfinite(total)


def source_failures(parts: dict, failable: list[str], prefix: str = "reward") -> dict:
    """{prefix/<name>/failed: rows whose <name> reward failed} for the sources that can fail."""
    return {f"{prefix}/{name}/failed": float(np.isnan(parts[name]).sum()) for name in failable if name in parts}


def finite_mean(x: np.ndarray) -> float:
    """The mean of the finite entries (NaN when there are none)."""
    x = np.asarray(x, np.float64)
    ok = np.isfinite(x)
    return float(x[ok].mean()) if ok.any() else float("nan")


class RewardFailures:
    """Counts failed rollouts over the run; `record` returns the step's metrics or stops the run."""

    def __init__(self, max_share: float):
        self.max_share, self.failed, self.seen = max_share, 0, 0

    def record(self, total: np.ndarray, parts: dict, failable: list[str], errors: dict[str, str]) -> dict:
        failed = int(failed_rows(total).sum())
        self.failed, self.seen = self.failed + failed, self.seen + len(total)
        share = self.failed / max(self.seen, 1)
        if failed and share > self.max_share:
            reasons = "; ".join(errors.values()) or "the reasons are in process 0's log"
            raise UserError(
                f"rl: the rewards of {failed} of {len(total)} rollouts failed this step ({self.failed} of "
                f"{self.seen}, {share:.1%}, since the run started; rl.max_reward_failures="
                f"{self.max_share:g}): {reasons}"
            )
        return {"reward_failed": float(failed), "reward_failed_share": share} | source_failures(parts, failable)

    def state(self) -> dict:
        return {"failed": self.failed, "seen": self.seen}

    def restore(self, state: dict) -> None:
        self.failed, self.seen = int(state["failed"]), int(state["seen"])
