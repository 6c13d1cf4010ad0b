"""Qwen2 / Qwen2.5 (biases on q, k and v only; small models tie their embeddings) and Qwen3
(per-head RMSNorm on queries and keys; head_dim need not be d_model / heads)."""

from __future__ import annotations

from lm.model.families.common import shared_keys, hf_base, layer_types, llama_like, refuse, rope_config, rope_parameters, rope_to_hf

MODEL_TYPES = ("qwen2", "qwen3")


def model_config(hf: dict, source: str) -> dict:
    qwen3 = hf["model_type"] == "qwen3"
    refuse(hf, source, hidden_act=lambda v: v != "silu", attention_bias=lambda v: qwen3 and bool(v))
    out = shared_keys(hf, source) | dict(mlp="swiglu", qkv_bias=not qwen3 or bool(hf.get("attention_bias")),
                                         qk_norm=qwen3)
    out |= rope_config(rope_parameters(hf), hf, source)
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        start = hf.get("max_window_layers", out["n_layers"])
        types = layer_types(hf, out["n_layers"], lambda i: i >= start)
        if "local" in types:
            out |= dict(sliding_window=int(hf["sliding_window"]), layer_types=types)
    return out


def tensors(spec):
    return llama_like(spec, bias=spec.qkv_bias, qk_norm=spec.qk_norm)


def hf_config(m) -> dict:
    qwen3 = m.family == "qwen3"
    out = hf_base(m, "Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM")
    out |= {"hidden_act": "silu", "rope_parameters": rope_to_hf(m), "rope_theta": m.rope_theta,
            "use_sliding_window": False, "sliding_window": None}
    if qwen3:
        out["attention_bias"] = False
    return out
