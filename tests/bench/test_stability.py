"""bench/stability.py's figures: the learning-rate sensitivity by hand, and its flags."""

import math

import pytest

from bench.stability import parse_args, sensitivity


def test_sensitivity_is_the_mean_excess_over_the_best_with_divergence_at_the_baseline():
    # losses 3.0 (the best), 3.5, NaN (diverged: counted at 6.0), 9.0 (above the baseline: 6.0)
    assert sensitivity([3.0, 3.5, math.nan, 9.0], best=3.0, ceiling=6.0) == pytest.approx((0 + 0.5 + 3 + 3) / 4)


def test_flags():
    args = parse_args(["--lrs", "1e-3, 3e-2", "--steps", "5"])
    assert args.lrs == [1e-3, 3e-2] and args.steps == 5
    for bad in (["--lrs", "x"], ["--lrs", "-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
