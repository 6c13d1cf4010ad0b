"""Llama (2, 3, 3.1, 3.2) and Mistral: the plain pre-norm SwiGLU decoder with RoPE and GQA. Models
trained here have this shape and export as Llama."""

from __future__ import annotations

from lm.store.hf.families.common import llama_like
from lm.store.hf.families.config_keys import (
    REFUSED,
    hf_base,
    refuse,
    rope_config,
    rope_parameters,
    rope_to_hf,
    shared_keys,
    window,
    with_defaults,
)

MODEL_TYPES = ("llama", "mistral")
# transformers' defaults for the keys a config.json may leave out (LlamaConfig, MistralConfig)
DEFAULTS = {
    "llama": dict(hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral": dict(
        hidden_act="silu",
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        sliding_window=4096,
    ),
}


def model_config(hf: dict, source: str) -> dict:
    hf = with_defaults(hf, DEFAULTS[hf["model_type"]])
    refuse(hf, source, hidden_act=lambda v: v != "silu", **REFUSED)
    if hf["model_type"] == "llama":  # Mistral's projections have no biases whatever the config says
        refuse(hf, source, attention_bias=bool, mlp_bias=bool)
    out = shared_keys(hf, source) | dict(mlp="swiglu")
    out |= rope_config(rope_parameters(hf, source), hf, source)
    if hf["model_type"] == "mistral" and hf.get("sliding_window") is not None:  # every layer
        out |= window(hf, ("local",) * out["n_layers"], source)
    return out


def tensors(spec):
    return llama_like(spec)


def hf_config(m) -> dict:
    family = m.family or "llama"
    out = hf_base(m, "MistralForCausalLM" if family == "mistral" else "LlamaForCausalLM")
    out |= {
        "model_type": family,
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(m),
        "rope_theta": m.rope_theta,
        "attention_bias": False,
    }
    if family == "llama":
        out["mlp_bias"] = False
    if family == "mistral":
        out["sliding_window"] = m.sliding_window or None
    return out


# What a model trained here must look like to be a Llama checkpoint.
LLAMA_SHAPE = dict(
    mlp="swiglu",
    norm="rmsnorm",
    use_bias=False,
    position="rope",
    qkv_bias=False,
    qk_norm=False,
    post_norms=False,
    embed_scale=False,
    attn_scale=0.0,
    attn_softcap=0.0,
    final_softcap=0.0,
    layer_types=(),
)


def unsupported(m, shape: dict = LLAMA_SHAPE, name: str = "Llama") -> list[str]:
    """The model-section keys that keep a model trained here from being a checkpoint of `shape`
    (by default a Llama one)."""
    value = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
    return [f"model.{k}={value(m[k])!r} ({name} needs {v!r})" for k, v in shape.items() if value(m[k]) != v]
