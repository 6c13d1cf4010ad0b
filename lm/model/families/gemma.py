"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(d_model), norms stored as (1 + w), a norm
before and after each sub-block, GeGLU, queries scaled by query_pre_attn_scalar, soft-capped
attention and output logits (Gemma 2), q/k norms (Gemma 3), and local sliding-window layers
beside global ones, each kind with its own RoPE base (Gemma 3)."""

from __future__ import annotations

from lm.errors import UserError
from lm.model.families.common import shared_keys, hf_base, layer_types, llama_like, refuse, rope_config, rope_parameters, rope_to_hf

MODEL_TYPES = ("gemma2", "gemma3_text")


def model_config(hf: dict, source: str) -> dict:
    gemma3 = hf["model_type"] == "gemma3_text"
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    refuse(hf, source, attention_bias=bool, use_bidirectional_attention=bool)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UserError(f"{source}: config.json key 'hidden_activation' = {act!r} is not supported (Gemma's is gelu_pytorch_tanh)")
    out = shared_keys(hf, source) | dict(mlp="geglu", post_norms=True, embed_scale=True, qk_norm=gemma3,
                                         tie_embeddings=True)
    out["attn_scale"] = float(hf.get("query_pre_attn_scalar") or out["head_dim"]) ** -0.5
    out["attn_softcap"] = float(hf.get("attn_logit_softcapping") or 0.0)
    out["final_softcap"] = float(hf.get("final_logit_softcapping") or 0.0)
    if gemma3:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = layer_types(hf, out["n_layers"], lambda i: (i + 1) % pattern != 0)
        out |= rope_config(rope_parameters(hf, "full_attention"), hf, source)
        local = rope_parameters(hf, "sliding_attention")
        if local["rope_type"] != "default":
            raise UserError(f"{source}: scaled RoPE on sliding-window layers ('{local['rope_type']}') is not supported")
        out["rope_local_theta"] = float(hf.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
    else:
        types = layer_types(hf, out["n_layers"], lambda i: (i + 1) % 2 != 0)
        out |= rope_config(rope_parameters(hf), hf, source)
    if "local" in types:
        out |= dict(sliding_window=int(hf["sliding_window"]), layer_types=types)
    return out


def tensors(spec):
    return llama_like(spec, norm_kind="id+1", qk_norm=spec.qk_norm, post_norms=True)


def hf_config(m) -> dict:
    gemma3 = m.family == "gemma3_text"
    out = hf_base(m, "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM")
    out |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _scalar(m.attn_scale),
            "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None,
            "sliding_window": m.sliding_window or None, "attention_bias": False,
            "layer_types": [("sliding_attention" if t == "local" else "full_attention") for t in m.layer_types] or None}
    if gemma3:
        out["rope_parameters"] = {"full_attention": rope_to_hf(m),
                                  "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_local_theta}}
    else:
        out["rope_parameters"] = rope_to_hf(m)
    return out


def _scalar(scale: float):
    """query_pre_attn_scalar from our scale (scalar ** -0.5): an int where it is one, as transformers requires."""
    value = round(scale ** -2, 6)
    return int(value) if value == int(value) else value
