"""Ahead-of-time compilation of a config's train step on a mesh of (possibly simulated) devices.

Nothing is allocated: the state and batch are abstract. This catches sharding and shape
errors of a large config before it reaches the accelerators, and reports compile time and
the per-device memory XLA plans for arguments, outputs and temporaries.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from lm.config import rules_table
from lm.data.pipeline import BATCH_DTYPES
from lm.model.layers import ModelSpec, Partitioning
from lm.model.transformer import Transformer
from lm.sharding import batch_sharding, make_mesh
from lm.train.losses import pretrain_loss
from lm.train.optim import make_optimizer
from lm.train.state import abstract_state, state_shardings
from lm.train.steps import make_train_step


def compile_train_step(config, devices=None) -> dict:
    """Lowers and compiles the pretrain step for config on `devices`; returns figures."""
    mesh = make_mesh(config.mesh, devices)
    rules = rules_table(config)
    spec = ModelSpec.from_config(config.model)
    if jax.default_backend() != "gpu" and spec.attention == "cudnn":
        spec = dataclasses.replace(spec, attention="xla")  # cuDNN kernels lower only for GPUs
    model = Transformer(spec, Partitioning(mesh, rules))
    optimizer, schedule = make_optimizer(config.optim, config.train.steps)
    shardings = state_shardings(model, optimizer, mesh, rules)
    state = abstract_state(model, optimizer, shardings)
    b_sharding = batch_sharding(mesh, rules)
    shape = (config.train.batch_size, config.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=b_sharding) for k, dt in BATCH_DTYPES.items()}
    step = make_train_step(pretrain_loss(model, config.optim.z_loss), optimizer, schedule, mesh, shardings,
                           b_sharding, config.train.micro_batches)
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    figures = {"backend": jax.default_backend(), "devices": mesh.size, "mesh": dict(mesh.shape),
               "attention": spec.attention, "compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                     "alias_size_in_bytes"):
            figures[name.replace("_size_in_bytes", "_bytes_per_device")] = int(getattr(memory, name, 0))
    return figures
