"""MFU arithmetic and the matmul-peak measurement."""

import math
import time

from lm.train.perf import measure_matmul_peak, mfu


def test_mfu_is_achieved_over_peak():
    # 1,000 tokens/s x 6e6 FLOPs per token = 6e9 FLOP/s against a 1e10 peak.
    assert math.isclose(mfu(1000, 6e6, 1e10), 0.6)
    assert mfu(1000, 6e6, 0.0) == 0.0  # no peak known: no figure rather than a division error


def test_peak_keeps_measuring_for_the_minimum_time():
    start = time.perf_counter()
    peak = measure_matmul_peak("float32", n=64, repeats=1, min_seconds=0.3)
    assert time.perf_counter() - start >= 0.3
    assert math.isfinite(peak) and peak > 2 * 64**3  # at least one n^3 matmul per second
