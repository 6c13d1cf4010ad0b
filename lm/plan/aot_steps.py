"""The jitted steps of every stage, with abstract arguments (ShapeDtypeStructs carrying their
shardings): what `lm.plan.aot` lowers and compiles for a target. The steps and their builders are
declared in the stage registry (lm.train.registry.CompiledStep); each builder makes the step the
stage itself runs (the same lm.train.setup.Run, loss and batch signature), so a compile here is a
compile of the real thing; nothing is allocated. Today's steps:

    pretrain   next-token loss, the whole model trained
    sft        the SFT loss, the whole model trained
    sft_lora   the SFT loss over LoRA adapters (model.lora_rank, 16 when the config has none); the
               base frozen in the compute dtype (as an imported bf16 checkpoint stays), or its
               layers' weights 4-bit with model.lora_base_quant (QLoRA)
    dpo        DPO with a live reference (a frozen copy in the compute dtype), pairs per row
    rl         one GRPO/PPO update minibatch (rl.*), with the reference when the KL needs one
    decode     the generation engine's decode block: eval.batch_size slots against a paged KV pool
               holding each slot's whole generation context, params in the compute dtype
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lm.config import Config, rules_table, with_values
from lm.infer.engine.engine import Engine, EngineConfig
from lm.infer.generate import generation_context
from lm.model.build import build_model
from lm.model.params import split_params
from lm.model.quant import abstract_base
from lm.model.spec import ModelSpec
from lm.train.registry import compiled_step, load, step_names

STEPS = step_names()  # the registry's at import (lm.train.registry.step_names: any registered since)
DEFAULT_LORA_RANK = 16


@dataclasses.dataclass(frozen=True)
class StepBuild:
    """A jitted step, its abstract arguments and the config it was built from."""

    name: str
    fn: object
    args: tuple
    config: Config


def abstract(tree, shardings, dtype=None):
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) with `shardings`; floating leaves
    in `dtype` when given (a frozen copy in the compute dtype)."""

    def one(x, sh):
        dt = dtype if dtype is not None and np.issubdtype(x.dtype, np.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dt, sharding=sh)

    return jax.tree.map(one, tree, shardings)


def abstract_frozen(run, base_dtype) -> dict | None:
    """What a run's step takes frozen (a LoRA base, a reference, ...), abstract: as Run._frozen
    places it (lm.train.setup), with the LoRA base in `base_dtype`."""
    if run.frozen_shardings is None:
        return None
    out = {}
    if run.trainable is not None:
        base = split_params(run.built.abstract_params(), run.trainable)[1]
        floats = split_params(run.built.param_shardings, run.trainable)[1]
        out["base"] = abstract_base(base, floats, run.base_quant, base_dtype)  # 4-bit layers under QLoRA
    for name, slot in run.frozen.items():
        out[name] = (
            out["base"]
            if slot.shares_base
            else abstract(slot.built.abstract_params(), slot.built.param_shardings, slot.dtype)
        )
    return out


def _train(name, run, signature, base_dtype) -> StepBuild:
    shardings = run.batch_shardings(signature)
    batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k]) for k, s in signature.items()}
    frozen = abstract_frozen(run, base_dtype)
    args = (run.abstract_state(), batch) + ((frozen,) if frozen is not None else ())
    return StepBuild(name, run.train_step(signature), args, run.config)


def _spec(config, devices) -> ModelSpec:
    """The config's spec, with the kernels and attention the target compiles (cuDNN's only on GPUs;
    the CPU kernels only on the CPU backend)."""
    spec = ModelSpec.from_config(config.model)
    on_cpu = devices[0].platform == "cpu"
    if devices[0].platform != "gpu" and spec.attention.kernel == "cudnn":
        spec = spec.replace(attention=dict(kernel="xla"))
    if spec.kernels == "auto":
        spec = spec.replace(kernels="cpu" if on_cpu else "plain")
    return spec


def build_step(name: str, config, devices) -> StepBuild:
    """The compiled step `name` (lm.train.registry.compiled_steps) of `config` on `devices` (real or
    a TPU topology's): built with model.lora_rank=0, or over LoRA adapters for a `lora` step."""
    step = compiled_step(name)
    dtype = config.model.compute_dtype
    lora_rank = (config.model.lora_rank or DEFAULT_LORA_RANK) if step.lora else 0
    base_quant = config.model.lora_base_quant if lora_rank else "none"  # QLoRA's base: LoRA steps only
    config = with_values(config, {"model.lora_rank": lora_rank, "model.lora_base_quant": base_quant})
    if step.generation:
        return load(step.build)(config, devices)
    run, signature = load(step.build)(config, devices, _spec(config, devices))
    return _train(name, run, signature, dtype)


def _decode(config, devices) -> StepBuild:
    """The engine's decode block (lm.infer.engine) over eval.batch_size slots, each holding a whole
    generation context in the paged pool: the program `lm sample`, `lm serve`, evaluation and RL
    rollouts decode with. Layers stay stacked (the CPU kernel path unstacks them at run time)."""
    config = with_values(config, {"model.lora_rank": 0, "model.lora_base_quant": "none"})
    built = build_model(config, devices, rules=rules_table(config), spec=_spec(config, devices))
    engine = Engine(
        built.module,
        max_len=generation_context(built.spec),
        config=EngineConfig(slots=config.eval.batch_size),
        mesh=built.mesh,
        rules=built.rules,
        unstack=False,
    )
    params = abstract(built.abstract_params(), built.param_shardings, config.model.compute_dtype)
    fn, args = engine.abstract_decode(params)
    return StepBuild("decode", fn, args, config)
