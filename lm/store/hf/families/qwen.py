"""Qwen2 / Qwen2.5 (biases on q, k and v only; small models tie their embeddings) and Qwen3
(per-head RMSNorm on queries and keys; head_dim need not be d_model / heads)."""

from __future__ import annotations

from lm.store.hf.families.common import llama_like
from lm.store.hf.families.config_keys import (
    REFUSED,
    hf_base,
    layer_types,
    refuse,
    rope_config,
    rope_parameters,
    rope_to_hf,
    shared_keys,
    typed,
    window,
    with_defaults,
)
from lm.store.hf.families.llama import LLAMA_SHAPE
from lm.store.hf.families.llama import unsupported as llama_unsupported

MODEL_TYPES = ("qwen2", "qwen3")
# transformers' defaults for the keys a config.json may leave out (Qwen2Config, Qwen3Config)
QWEN2 = dict(
    hidden_act="silu",
    num_key_value_heads=32,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
)
DEFAULTS = {"qwen2": QWEN2, "qwen3": QWEN2 | dict(head_dim=128, attention_bias=False)}


def model_config(hf: dict, source: str) -> dict:
    qwen3 = hf["model_type"] == "qwen3"
    hf = with_defaults(hf, DEFAULTS[hf["model_type"]])
    # Qwen2's q/k/v projections always have biases, its output projection never: attention_bias is not read
    refuse(hf, source, hidden_act=lambda v: v != "silu", attention_bias=lambda v: qwen3 and bool(v), **REFUSED)
    out = shared_keys(hf, source) | dict(mlp="swiglu", qkv_bias=not qwen3, qk_norm=qwen3)
    out |= rope_config(rope_parameters(hf, source), hf, source)
    if typed(hf, "use_sliding_window", "bool", source, False) and hf.get("sliding_window") is not None:
        start = typed(hf, "max_window_layers", "int0", source, 0)
        out |= window(hf, layer_types(hf, out["n_layers"], lambda i: i >= start, source), source)
    return out


def tensors(spec):
    return llama_like(spec, bias=spec.attention.qkv_bias, qk_norm=spec.attention.qk_norm)


def hf_config(m) -> dict:
    qwen3 = m.family == "qwen3" or (not m.family and m.qk_norm)  # a model trained here with QK-norm
    out = hf_base(m, "Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM")
    out |= {
        "model_type": "qwen3" if qwen3 else "qwen2",
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(m),
        "rope_theta": m.rope_theta,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if qwen3:
        out["attention_bias"] = False
    return out


# What a model trained here must look like to be a Qwen3 checkpoint: a Llama's shape with QK-norm.
QWEN3_SHAPE = LLAMA_SHAPE | dict(qk_norm=True)


def unsupported(m) -> list[str]:
    """The model-section keys that keep a model trained here from being a Qwen3 checkpoint."""
    return llama_unsupported(m, QWEN3_SHAPE, "Qwen3")
