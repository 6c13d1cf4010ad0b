"""Llama (2, 3, 3.1, 3.2) and Mistral: the plain pre-norm SwiGLU decoder with RoPE and GQA. Models
trained here have this shape and export as Llama."""

from __future__ import annotations

from lm.model.families.common import shared_keys, hf_base, llama_like, refuse, rope_config, rope_parameters, rope_to_hf

MODEL_TYPES = ("llama", "mistral")


def model_config(hf: dict, source: str) -> dict:
    refuse(hf, source, hidden_act=lambda v: v != "silu", attention_bias=bool, mlp_bias=bool,
           pretraining_tp=lambda v: v != 1)
    out = shared_keys(hf, source) | dict(mlp="swiglu")
    out |= rope_config(rope_parameters(hf), hf, source)
    window = hf.get("sliding_window") if hf["model_type"] == "mistral" else None
    if window:
        out |= dict(sliding_window=int(window), layer_types=("local",) * out["n_layers"])
    return out


def tensors(spec):
    return llama_like(spec)


def hf_config(m) -> dict:
    family = m.family or "llama"
    out = hf_base(m, "MistralForCausalLM" if family == "mistral" else "LlamaForCausalLM")
    out |= {"model_type": family, "hidden_act": "silu", "rope_parameters": rope_to_hf(m),
            "rope_theta": m.rope_theta, "attention_bias": False}
    if family == "llama":
        out["mlp_bias"] = False
    if family == "mistral":
        out["sliding_window"] = m.sliding_window or None
    return out


# What a model trained here must look like to be a Llama checkpoint.
LLAMA_SHAPE = dict(mlp="swiglu", norm="rmsnorm", use_bias=False, position="rope", qkv_bias=False, qk_norm=False,
                   post_norms=False, embed_scale=False, attn_scale=0.0, attn_softcap=0.0, final_softcap=0.0,
                   layer_types=())


def unsupported(m, shape: dict = LLAMA_SHAPE, name: str = "Llama") -> list[str]:
    """The model-section keys that keep a model trained here from being a checkpoint of `shape`
    (by default a Llama one)."""
    value = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
    return [f"model.{k}={value(m[k])!r} ({name} needs {v!r})" for k, v in shape.items() if value(m[k]) != v]
