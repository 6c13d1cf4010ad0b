"""Ahead-of-time compilation of a config's train step on a mesh of (possibly simulated) devices.

Nothing is allocated: the state and batch are abstract. This catches sharding and shape
errors of a large config before it reaches the accelerators, and reports compile time and
the per-device memory XLA plans for arguments, outputs and temporaries.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from lm.model.layers import ModelSpec
from lm.train.setup import build_run


def compile_train_step(config, devices=None) -> dict:
    """Lowers and compiles the pretrain step for config on `devices`; returns figures."""
    spec = ModelSpec.from_config(config.model)
    if jax.default_backend() != "gpu" and spec.attention == "cudnn":
        spec = dataclasses.replace(spec, attention="xla")  # cuDNN kernels lower only for GPUs
    run = build_run(config, devices=devices, spec=spec)
    signature = run.signature()
    shardings = run.batch_shardings(signature)
    batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k]) for k, s in signature.items()}
    step = run.train_step(signature)
    start = time.perf_counter()
    compiled = step.lower(run.abstract_state(), batch).compile()
    figures = {"backend": jax.default_backend(), "devices": run.mesh.size, "mesh": dict(run.mesh.shape),
               "attention": spec.attention, "compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                     "alias_size_in_bytes"):
            figures[name.replace("_size_in_bytes", "_bytes_per_device")] = int(getattr(memory, name, 0))
    return figures
