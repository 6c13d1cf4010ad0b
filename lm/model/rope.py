"""Rotary position embeddings: the frequencies (plain, or scaled for long context as published
checkpoints define them: linear, Llama 3, YaRN) and the rotation.

Channel pairs are (i, i + H/2) ("rotate half"), the layout of Hugging Face checkpoints, so their
q/k weights load without a permutation. Frequencies are computed in float32 numpy from the spec
(static), as the reference implementations compute them in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def inv_frequencies(
    head_dim: int,
    theta: float,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_len: int = 8192,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float = 0.0,
    truncate: bool = True,
) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [H/2], the factor cos and sin are multiplied by)."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    base = np.float32(theta) ** exps
    inv = (np.float32(1.0) / base).astype(np.float32)
    if scaling == "none":
        return inv, 1.0
    if scaling == "linear":
        return (inv / np.float32(factor)).astype(np.float32), 1.0
    if scaling == "llama3":
        return _llama3(inv, factor, low_freq_factor, high_freq_factor, original_max_len), 1.0
    if scaling == "yarn":
        return _yarn(
            base, head_dim, theta, factor, original_max_len, beta_fast, beta_slow, truncate
        ), attention_factor or _yarn_mscale(factor)
    raise ValueError(f"unknown RoPE scaling {scaling!r}")


def _llama3(inv, factor, low_freq_factor, high_freq_factor, original_max_len):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _yarn(base, head_dim, theta, factor, original_max_len, beta_fast, beta_slow, truncate):
    """YaRN: interpolated frequencies for low-frequency dims, extrapolated for high, a linear ramp between."""

    def correction_dim(rotations):
        return head_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_extra = (np.float32(1.0) / base).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * base)).astype(np.float32)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def spec_tables(spec, positions: jax.Array, local: bool = False):
    """`rope_tables` for a ModelSpec's global layers, or for its local (sliding-window) layers:
    their own base (rope.local_theta), never scaled."""
    if local:
        return rope_tables(positions, spec.attention.head_dim, spec.rope.local_theta or spec.rope.theta)
    if spec.rope.scaling == "none":
        return rope_tables(positions, spec.attention.head_dim, spec.rope.theta)
    return rope_tables(positions, spec.attention.head_dim, spec.rope.theta, *spec_frequencies(spec))


def spec_frequencies(spec) -> tuple[np.ndarray, float]:
    """The scaled frequencies of a ModelSpec's global layers and their cos/sin factor."""
    r = spec.rope
    return inv_frequencies(
        spec.attention.head_dim,
        r.theta,
        r.scaling,
        r.factor,
        r.low_freq_factor,
        r.high_freq_factor,
        r.original_max_len,
        r.beta_fast,
        r.beta_slow,
        r.attention_factor,
        r.truncate,
    )


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, inv_freq: np.ndarray | None = None, attention_factor: float = 1.0
):
    """(cos, sin), each [B, T, 1, 2, H/2] float32, for `apply_rope`; sin carries the rotation's sign.
    inv_freq: scaled frequencies (`inv_frequencies`); None: theta ** (-i / (H/2)).

    Computed once per forward pass: a fused consumer would otherwise recompute the sines
    and cosines for every head of every layer.
    """
    half = head_dim // 2
    if inv_freq is None:
        freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freqs = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return jnp.stack([cos, cos], axis=-2)[:, :, None], jnp.stack([-sin, sin], axis=-2)[:, :, None]


def apply_rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates channel pairs (i, i + H/2) of x [B, T, N, H] by the angles in `tables`.

    The halves are swapped by reversing a size-2 axis rather than by split and concatenate,
    so forward and backward each stay one elementwise pass.
    """
    cos, sin = tables
    b, t, n, h = x.shape
    xf = x.astype(jnp.float32).reshape(b, t, n, 2, h // 2)
    return (xf * cos + xf[..., ::-1, :] * sin).reshape(x.shape).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Plain RoPE of x [B, T, N, H] at integer positions [B, T]."""
    return apply_rope(x, rope_tables(positions, x.shape[-1], theta))
