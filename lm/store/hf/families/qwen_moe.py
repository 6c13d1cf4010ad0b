"""Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm, no biases) with every MLP replaced by
`num_experts` SwiGLU experts of width `moe_intermediate_size`; the router takes a softmax over all
experts and keeps the top `num_experts_per_tok`, renormalised to sum 1 only with `norm_topk_prob`.

Refused: dense layers between the sparse ones (`mlp_only_layers`, `decoder_sparse_step` != 1)
and shared experts. A sliding window (`use_sliding_window`) covers every layer, as transformers
computes it (it reads no `max_window_layers` for this family).
"""

from __future__ import annotations

from lm.errors import UserError
from lm.store.hf.families.common import expert_maps, llama_like
from lm.store.hf.families.config_keys import (
    REFUSED,
    hf_base,
    moe_keys,
    refuse,
    rope_config,
    rope_parameters,
    rope_to_hf,
    shared_keys,
    typed,
    window,
    with_defaults,
)
from lm.store.hf.families.llama import unsupported as llama_unsupported
from lm.store.hf.families.mixtral import MIXTRAL_SHAPE

MODEL_TYPES = ("qwen3_moe",)
# transformers' defaults for the keys a config.json may leave out (Qwen3MoeConfig)
DEFAULTS = dict(
    hidden_act="silu",
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    intermediate_size=6144,
    use_sliding_window=False,
    sliding_window=4096,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=False,
    router_aux_loss_coef=0.001,
)


def model_config(hf: dict, source: str) -> dict:
    hf = with_defaults(hf, DEFAULTS)
    refuse(
        hf,
        source,
        hidden_act=lambda v: v != "silu",
        attention_bias=bool,
        mlp_only_layers=bool,
        decoder_sparse_step=lambda v: v != 1,
        shared_expert_intermediate_size=bool,
        **REFUSED,
    )
    out = shared_keys(hf, source) | dict(mlp="swiglu", qk_norm=True)
    norm = typed(hf, "norm_topk_prob", "bool", source, False)
    out |= moe_keys(hf, source, 128, "moe_intermediate_size", router_norm=norm)
    out |= rope_config(rope_parameters(hf, source), hf, source)
    if typed(hf, "use_sliding_window", "bool", source, False) and hf.get("sliding_window") is not None:
        out |= window(hf, ("local",) * out["n_layers"], source)  # every layer; layer_types is not read
    return out


def tensors(spec):
    return llama_like(spec, qk_norm=True) + expert_maps(
        ("model.layers.{i}.mlp.",), ("gate_proj", "up_proj", "down_proj")
    )


def hf_config(m) -> dict:
    local = "local" in m.layer_types
    if local and "global" in m.layer_types:
        raise UserError(
            f"model.layer_types={tuple(m.layer_types)!r}: a Qwen3-MoE checkpoint has a sliding window "
            "on every layer or on none"
        )
    out = hf_base(m, "Qwen3MoeForCausalLM")
    out |= {
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(m),
        "rope_theta": m.rope_theta,
        "attention_bias": False,
        "use_sliding_window": local,
        "sliding_window": m.sliding_window if local else None,
        "max_window_layers": m.n_layers,
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": m.expert_d_ff or m.d_ff,
        "norm_topk_prob": bool(m.router_norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": m.moe_balance_coef,
    }
    return out


# What a model trained here must look like to be a Qwen3-MoE checkpoint: Mixtral's shape with
# QK-norm, the top-k weights renormalised or not (norm_topk_prob).
QWEN3_MOE_SHAPE = {k: v for k, v in MIXTRAL_SHAPE.items() if k != "router_norm"} | dict(qk_norm=True)


def unsupported(m) -> list[str]:
    """The model-section keys that keep a model trained here from being a Qwen3-MoE checkpoint."""
    return llama_unsupported(m, QWEN3_MOE_SHAPE, "Qwen3-MoE")
