"""Measured hardware figures: the matmul peak that MFU is reported against."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5, min_seconds: float = 1.0) -> float:
    """FLOP/s of an n×n×n matmul on the default device (float32 accumulation).

    The best of at least `repeats` runs, repeated until `min_seconds` have passed: on a
    machine whose speed drifts (shared or throttled cores), a handful of runs can all land in
    a slow spell, and MFU against such a peak overstates the run (even above 100%).
    """
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, b).block_until_ready()
    best, runs, begin = float("inf"), 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - begin < min_seconds:
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best, runs = min(best, time.perf_counter() - start), runs + 1
    return 2 * n**3 / best


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0
