"""The model's hyperparameters as one hashable value (a static jit argument), in small frozen parts
by what each module reads. No field defaults: the config's model section holds them; build a spec
with `ModelSpec.from_config` and change it with `ModelSpec.replace` (the model imports no config)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lm.model.counts import expert_d_ff, head_dim


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Heads, their kernel and the published variations of attention (lm.model.attention)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    kernel: str  # auto | splash | flash | blockwise | xla | cudnn | reference
    scale: float  # attention logits times this; 0: head_dim ** -0.5
    softcap: float  # logits -> cap * tanh(logits / cap); 0: off
    sliding_window: int  # keys a "local" layer sees, itself included
    layer_types: tuple  # per layer "global" or "local"; empty: all global
    qkv_bias: bool  # biases on q/k/v only (use_bias puts them everywhere)
    qk_norm: bool  # a norm over head_dim on queries and keys before RoPE
    context: str  # allgather | ring: how attention runs with the sequence split over `context`


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary position frequencies (lm.model.rope), read when position == "rope"."""

    theta: float
    local_theta: float  # base of local layers, never scaled; 0: theta
    scaling: str  # none | linear | llama3 | yarn
    factor: float
    low_freq_factor: float  # llama3
    high_freq_factor: float  # llama3
    original_max_len: int  # llama3, yarn
    beta_fast: float  # yarn
    beta_slow: float  # yarn
    attention_factor: float  # yarn: cos/sin times this; 0: 0.1 ln(factor) + 1
    truncate: bool  # yarn: correction range rounded to whole dims


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """Every norm (lm.model.layers.Norm) and where the blocks put them."""

    kind: str  # rmsnorm | layernorm
    eps: float
    post_norms: bool  # a norm on each sub-block's output before the residual add


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    """The dense MLP of each block (lm.model.layers.Mlp)."""

    kind: str  # swiglu | geglu | gelu
    d_ff: int


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Routed experts in place of the dense MLP (lm.model.moe); n_experts 0: none."""

    n_experts: int
    experts_per_token: int
    expert_d_ff: int
    shared_d_ff: int  # a dense SwiGLU every token also takes; 0: none
    router_score: str  # softmax | sigmoid
    router_norm: bool  # the chosen experts' weights renormalised to sum to 1
    capacity_factor: float  # 0: dropless
    balance_coef: float  # load-balancing loss weight
    z_coef: float  # router z-loss weight


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters (lm.model.lora) on the projections named in targets; rank 0: none."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """Pipeline schedule (lm.model.pipeline); the number of stages comes from the mesh."""

    microbatches: int  # 0: as many as stages
    repeats: int  # 1: GPipe; r > 1: circular
    schedule: str  # gpipe | 1f1b (lm.model.pipeline_schedule)


PARTS = dict(
    attention=AttentionSpec,
    rope=RopeSpec,
    norm=NormSpec,
    mlp=MlpSpec,
    moe=MoeSpec,
    lora=LoraSpec,
    pipeline=PipelineSpec,
)

# The model-section key of each part's field where it is not the field's own name.
CONFIG_KEYS = dict(
    attention=dict(kernel="attention", scale="attn_scale", softcap="attn_softcap", context="context_attention"),
    rope={f.name: "rope_" + f.name for f in dataclasses.fields(RopeSpec)},
    norm=dict(kind="norm", eps="norm_eps"),
    mlp=dict(kind="mlp"),
    moe=dict(balance_coef="moe_balance_coef", z_coef="moe_z_coef"),
    lora={f.name: "lora_" + f.name for f in dataclasses.fields(LoraSpec)},
    pipeline={f.name: "pipeline_" + f.name for f in dataclasses.fields(PipelineSpec)},
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The whole model: sizes, embedding and output choices, how it runs, and its parts."""

    vocab_size: int
    d_model: int
    n_layers: int
    max_seq_len: int
    position: str  # rope | learned
    use_bias: bool  # biases on every projection and layernorm
    tie_embeddings: bool
    embed_scale: bool  # embeddings times sqrt(d_model)
    final_softcap: float  # output logits -> cap * tanh(logits / cap); 0: off
    compute_dtype: str
    remat: str
    init_std: float
    kernels: str  # "cpu": lm.model.cpu_kernels; "plain": einsum + autodiff; "auto": cpu on CPU
    fp8: bool  # the blocks' projections as fp8 products (lm.model.fp8)
    fp8_scaling: str  # current | delayed (amax histories in the params)
    fp8_history: int  # steps of amax a delayed scale looks back over
    attention: AttentionSpec
    rope: RopeSpec
    norm: NormSpec
    mlp: MlpSpec
    moe: MoeSpec
    lora: LoraSpec
    pipeline: PipelineSpec

    @classmethod
    def from_config(cls, m: Mapping) -> ModelSpec:
        """The spec of a model section (any mapping of its keys); head_dim and expert_d_ff derived."""
        parts = {}
        for name, part in PARTS.items():
            keys = CONFIG_KEYS[name]
            parts[name] = part(**{f.name: m[keys.get(f.name, f.name)] for f in dataclasses.fields(part)})
        parts["attention"] = dataclasses.replace(
            parts["attention"], head_dim=head_dim(m), layer_types=tuple(m["layer_types"])
        )
        parts["moe"] = dataclasses.replace(parts["moe"], expert_d_ff=expert_d_ff(m))
        parts["lora"] = dataclasses.replace(parts["lora"], targets=tuple(m["lora_targets"]))
        top = {f.name: m[f.name] for f in dataclasses.fields(cls) if f.name not in PARTS}
        return cls(**top, **parts)

    def replace(self, **changes) -> ModelSpec:
        """A copy with `changes`: a top-level field by name, a part's fields as a dict under the
        part's name (`spec.replace(d_model=64, attention=dict(kernel="xla"))`)."""
        for name, value in changes.items():
            if name in PARTS and isinstance(value, Mapping):
                changes[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **changes)

    def without_lora(self) -> ModelSpec:
        """The same model with no adapters (a LoRA run's frozen base)."""
        return self.replace(lora=dict(rank=0))

    @property
    def has_local_layers(self) -> bool:
        return "local" in self.attention.layer_types

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def cpu_kernels(self) -> bool:
        """Whether matmuls and norms use lm.model.cpu_kernels (resolved when traced)."""
        if self.kernels == "auto":
            return jax.default_backend() == "cpu"
        return self.kernels == "cpu"
