"""Ahead-of-time compilation of a config's steps for a target: a Cloud TPU slice (the real TPU
compiler, from libtpu, on abstract TPU devices of the slice's topology: no TPU needed) or N CPU
devices (simulated with XLA_FLAGS=--xla_force_host_platform_device_count=N).

Nothing is allocated: every argument is a ShapeDtypeStruct with its sharding. The compiler
reports, per device, the bytes of the arguments, outputs (less those aliased to donated
arguments), temporaries and code, and its cost analysis (FLOPs, bytes accessed): this catches
sharding, shape and memory errors of a large config before it reaches the accelerators.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time

import jax

from lm.errors import UserError
from lm.plan.aot_steps import build_step
from lm.plan.hardware import Target
from lm.sharding import AXES, SIMULATE_HINT, mesh_shape

TPU_INSTALL = "pip install 'lm[tpu]' (libtpu, through jax[tpu]==0.10.2)"
# The compiler's refusal when a program needs more than the chip's HBM: its figure is kept.
_EXHAUSTED = re.compile(r"total memory required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def quiet_libtpu(target: Target) -> None:
    """libtpu, loaded off a TPU VM, looks for the VM's metadata and a lock file; tell it what it
    would find, so compiling prints no warnings and two compiles may run at once."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def target_devices(target: Target) -> list:
    """The devices a target compiles for: N of this process's CPU devices, or a TPU slice's
    abstract devices (its topology, as the TPU runtime lays it out)."""
    if target.platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < target.chips:
            raise UserError(f"--target {target.name}: this process has {len(devices)} CPU devices; {SIMULATE_HINT}")
        return devices[: target.chips]
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(
            f"--target {target.name} compiles with the TPU compiler, which comes with libtpu: {TPU_INSTALL}"
        )
    quiet_libtpu(target)
    from jax.experimental import topologies

    # v4 and v5p chips hold two TensorCores that run as one device ("megacore")
    kw = {"chip_config_name": "megacore"} if target.chip.cores_per_chip_in_name == 2 else {}
    return list(topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **kw).devices)


@dataclasses.dataclass
class Compiled:
    """One step's compile: per-device bytes from the compiler (None where it gave none), its cost
    analysis, and `error` when it refused (a program over the chip's memory, a bad sharding)."""

    step: str
    config: object
    compile_s: float
    arguments: int | None = None
    outputs: int | None = None  # not aliased to a donated argument
    temporaries: int | None = None
    code: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    error: str | None = None
    compiled: object = dataclasses.field(default=None, repr=False)

    @property
    def total(self) -> int | None:
        """Bytes the step needs on one device: arguments + outputs + temporaries + code."""
        if self.arguments is None:
            return self.temporaries  # a refusal names the temporaries alone
        return self.arguments + self.outputs + self.temporaries + self.code


def compile_step(name: str, config, devices) -> Compiled:
    """Lowers and compiles step `name` of `config` for `devices`; a setting the step refuses (a batch
    the mesh cannot split) or a program over the chip's memory comes back as `error`."""
    start = time.perf_counter()
    try:
        build = build_step(name, config, devices)
    except UserError as e:
        return Compiled(name, config, time.perf_counter() - start, error=str(e))
    try:
        compiled = build.fn.lower(*build.args).compile()
    except UserError as e:  # a setting the model refuses while tracing (a pipeline's micro-batches)
        return Compiled(name, build.config, time.perf_counter() - start, error=str(e))
    except jax.errors.JaxRuntimeError as e:
        message = str(e).strip().splitlines()[0]
        found = _EXHAUSTED.search(message)
        temp = int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None
        return Compiled(name, build.config, time.perf_counter() - start, temporaries=temp, error=message[:300])
    out = Compiled(name, build.config, time.perf_counter() - start, compiled=compiled)
    memory = compiled.memory_analysis()
    if memory is not None:
        out.arguments = int(memory.argument_size_in_bytes)
        out.outputs = int(memory.output_size_in_bytes - memory.alias_size_in_bytes)
        out.temporaries = int(memory.temp_size_in_bytes)
        out.code = int(memory.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost:
        out.flops, out.bytes_accessed = cost.get("flops"), cost.get("bytes accessed")
    return out


def compile_train_step(step: str, config, devices=None) -> dict:
    """The registered step `step` (`lm plan --steps` names) for config on `devices` (default: all of
    this process's): figures for the benches and tests that compile on the machine they run on."""
    devices = jax.devices() if devices is None else list(devices)
    c = compile_step(step, config, devices)
    if c.error:
        raise UserError(f"the {step} step does not compile: {c.error}")
    shape = dict(zip(AXES, mesh_shape(config.mesh, len(devices))))
    return {
        "backend": devices[0].platform,
        "devices": len(devices),
        "mesh": shape,
        "compile_s": c.compile_s,
        "argument_bytes_per_device": c.arguments,
        "output_bytes_per_device": c.outputs,
        "temp_bytes_per_device": c.temporaries,
        "code_bytes_per_device": c.code,
    }
