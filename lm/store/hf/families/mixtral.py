"""Mixtral: Mistral's decoder with every MLP replaced by `num_local_experts` SwiGLU experts, of
which a router picks `num_experts_per_tok` per token (softmax over all experts, the chosen
weights renormalised to sum 1). `intermediate_size` is each expert's width.

A model trained here with experts (model.n_experts > 0, model.family "") exports as Mixtral: it
is the plain MoE decoder, and transformers loads it everywhere. That needs Llama's shape (see
lm.store.hf.families.llama), softmax routing with router_norm, and no shared expert. HF runs the
experts dropless: a model trained with a capacity factor gives there the logits it gives here
with model.capacity_factor=0.
"""

from __future__ import annotations

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
    window,
    with_defaults,
)
from lm.store.hf.families.llama import LLAMA_SHAPE
from lm.store.hf.families.llama import unsupported as llama_unsupported

MODEL_TYPES = ("mixtral",)
LAYER = "model.layers.{i}."
# transformers' defaults for the keys a config.json may leave out (MixtralConfig; RoPE base 1e6)
DEFAULTS = dict(
    hidden_act="silu",
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.001,
)
ROPE_THETA = 1e6


def model_config(hf: dict, source: str) -> dict:
    hf = with_defaults(hf, DEFAULTS)
    refuse(hf, source, hidden_act=lambda v: v != "silu", **REFUSED)
    out = shared_keys(hf, source) | dict(mlp="swiglu")
    out |= moe_keys(hf, source, 8, "intermediate_size", router_norm=True)
    out |= rope_config(rope_parameters(hf, source, theta=ROPE_THETA), hf, source)
    if hf.get("sliding_window") is not None:  # every layer, as in Mistral
        out |= window(hf, ("local",) * out["n_layers"], source)
    return out


def tensors(spec):
    # transformers writes the experts as block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
    return llama_like(spec) + expert_maps((LAYER + "block_sparse_moe.", LAYER + "mlp."), ("w1", "w3", "w2"))


def hf_config(m) -> dict:
    out = hf_base(m, "MixtralForCausalLM")
    out |= {
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(m),
        "rope_theta": m.rope_theta,
        "intermediate_size": m.expert_d_ff or m.d_ff,
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.experts_per_token,
        "router_aux_loss_coef": m.moe_balance_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": m.sliding_window if "local" in m.layer_types else None,
    }
    return out


# What a model trained here must look like to be a Mixtral checkpoint.
MIXTRAL_SHAPE = LLAMA_SHAPE | dict(shared_d_ff=0, router_score="softmax", router_norm=True)


def unsupported(m) -> list[str]:
    """The model-section keys that keep a model trained here from being a Mixtral checkpoint."""
    return llama_unsupported(m, MIXTRAL_SHAPE, "Mixtral")
