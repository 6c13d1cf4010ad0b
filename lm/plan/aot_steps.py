"""The jitted steps of every stage, with abstract arguments (ShapeDtypeStructs carrying their
shardings): what `lm.plan.aot` lowers and compiles for a target. Each builder makes the step the
stage itself runs (the same lm.train.setup.Run, loss and batch signature), so a compile here is a
compile of the real thing; nothing is allocated.

    pretrain   next-token loss, the whole model trained
    sft        the SFT loss, the whole model trained
    sft_lora   the SFT loss over LoRA adapters (model.lora_rank, 16 when the config has none); the
               base frozen in the compute dtype (as an imported bf16 checkpoint stays)
    dpo        DPO with a live reference (a frozen copy in the compute dtype), pairs per row
    rl         one GRPO/PPO update minibatch (rl.*), with the reference when the KL needs one
    decode     one token for eval.batch_size rows against a KV cache of the generation context,
               params in the compute dtype
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lm.config import ConfigDict
from lm.infer.generate import generation_context
from lm.model.build import build_model
from lm.model.cache import abstract_cache, cache_shardings, decode_step
from lm.model.layers import ModelSpec
from lm.model.lora import is_adapter
from lm.model.params import split_params
from lm.train import pairs
from lm.train.dpo import build_dpo_run
from lm.train.losses import sft_loss
from lm.train.rl import build_rl_run, rl_config
from lm.train.rl_losses import RlSettings
from lm.train.rl_step import extra_fields
from lm.train.setup import build_run

STEPS = ("pretrain", "sft", "sft_lora", "dpo", "rl", "decode")
DEFAULT_LORA_RANK = 16


@dataclasses.dataclass(frozen=True)
class StepBuild:
    """A jitted step, its abstract arguments and the config it was built from."""

    name: str
    fn: object
    args: tuple
    config: ConfigDict


def with_keys(config, **dotted) -> ConfigDict:
    """A copy of `config` with keys set, each written section__name (the given config is never changed)."""
    out = ConfigDict(config.to_dict())
    for key, value in dotted.items():
        section, name = key.split("__")
        out[section][name] = value
    return out


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
        out["base"] = abstract(base, run.base_shardings, base_dtype)
    for name, slot in run.frozen.items():
        out[name] = out["base"] if slot.shares_base else abstract(
            slot.built.abstract_params(), slot.built.param_shardings, slot.dtype)
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
    if devices[0].platform != "gpu" and spec.attention == "cudnn":
        spec = dataclasses.replace(spec, attention="xla")
    if spec.kernels == "auto":
        spec = dataclasses.replace(spec, kernels="cpu" if on_cpu else "plain")
    return spec


def build_step(name: str, config, devices) -> StepBuild:
    """The step `name` (one of STEPS) of `config` on `devices` (real or a TPU topology's)."""
    dtype = config.model.compute_dtype
    if name == "pretrain":
        run = build_run(config, devices=devices, spec=_spec(config, devices))
        return _train(name, run, run.signature(), dtype)
    if name in ("sft", "sft_lora"):
        if name == "sft_lora":
            config = with_keys(config, model__lora_rank=config.model.lora_rank or DEFAULT_LORA_RANK)
        else:
            config = with_keys(config, model__lora_rank=0)
        run = build_run(config, sft_loss, devices=devices, spec=_spec(config, devices),
                        trainable=is_adapter if name == "sft_lora" else None)
        return _train(name, run, run.signature(), dtype)
    if name == "dpo":
        config = with_keys(config, dpo__reference="live", model__lora_rank=0)
        run = build_dpo_run(config, devices)
        return _train(name, run, run.signature(pairs=True, extra=pairs.PAIR_EXTRA), dtype)
    if name == "rl":
        config = rl_config(with_keys(config, model__lora_rank=0))
        run = build_rl_run(config, devices)
        fields = extra_fields(RlSettings.from_config(config.rl))
        t = config.data.seq_len
        return _train(name, run, run.signature(extra={k: ((t,), dt) for k, dt in fields.items()}), dtype)
    if name == "decode":
        return _decode(config, devices)
    raise ValueError(f"unknown step {name!r}")


def _decode(config, devices) -> StepBuild:
    config = with_keys(config, model__lora_rank=0)
    built = build_model(config, devices, spec=_spec(config, devices))
    rows = -(-config.eval.batch_size // built.batch_shards()) * built.batch_shards()
    length = generation_context(built.spec)
    params = abstract(built.abstract_params(), built.param_shardings, config.model.compute_dtype)
    shardings = cache_shardings(built.module, rows, length, built.mesh, built.rules)
    cache = abstract_cache(built.module, rows, length, shardings)
    token_sharding = built.batch_shardings({"t": (rows, 1)})["t"]
    token = jax.ShapeDtypeStruct((rows, 1), np.int32, sharding=token_sharding)
    model = built.module

    def step(params, cache, tokens, segment_ids, positions):
        return decode_step(model, params, cache, tokens, segment_ids, positions)

    fn = jax.jit(step, donate_argnums=1)
    return StepBuild("decode", fn, (params, cache, token, token, token), config)
