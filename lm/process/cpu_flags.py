"""Default XLA flags for the CPU backend; they take effect only if set before jax starts its backend.

At the matmul sizes of small-model training (e.g. 4096x384x1024 in float32), XLA's default
CPU path (YNNPACK fusions) leaves the second core mostly idle, while the Eigen path splits
every matmul over all cores; emptying the YNNPACK fusion list selects the Eigen path. For
bfloat16 it is the other way round: YNNPACK has native bfloat16 kernels and Eigen is 2-3x
slower, so the default stays. The flags only concern CPU compilation, so they are harmless
on GPU and TPU hosts.
"""

from __future__ import annotations

import os
import re

FLOAT32_DEFAULTS = ("--xla_cpu_experimental_ynn_fusion_type=",)


def cpu_defaults(compute_dtype: str) -> tuple[str, ...]:
    return FLOAT32_DEFAULTS if compute_dtype == "float32" else ()


def with_cpu_defaults(xla_flags: str, compute_dtype: str) -> str:
    """xla_flags plus each default whose flag name it does not already set (the user's value wins)."""
    flags = [xla_flags.strip()] if xla_flags.strip() else []
    for default in cpu_defaults(compute_dtype):
        name = default.split("=", 1)[0]
        if not re.search(rf"(^|\s){re.escape(name)}(=|\s|$)", xla_flags):
            flags.append(default)
    return " ".join(flags)


def apply_cpu_defaults(compute_dtype: str, environ=os.environ) -> None:
    """Adds the defaults for compute_dtype to environ['XLA_FLAGS']; call before jax is imported."""
    environ["XLA_FLAGS"] = with_cpu_defaults(environ.get("XLA_FLAGS", ""), compute_dtype)
