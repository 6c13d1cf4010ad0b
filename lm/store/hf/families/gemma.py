"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(d_model), norms stored as (1 + w), a norm
before and after each sub-block, GeGLU, queries scaled by query_pre_attn_scalar, soft-capped
attention and output logits (Gemma 2), q/k norms (Gemma 3), and local sliding-window layers
beside global ones, each kind with its own RoPE base (Gemma 3)."""

from __future__ import annotations

from lm.errors import UserError
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
    shown,
    typed,
    window,
    with_defaults,
)

MODEL_TYPES = ("gemma2", "gemma3_text")
# transformers' defaults for the keys a config.json may leave out (Gemma2Config, Gemma3TextConfig)
GEMMA = dict(
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
DEFAULTS = {
    "gemma2": GEMMA | dict(max_position_embeddings=8192, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": GEMMA | dict(max_position_embeddings=131072, sliding_window_pattern=6),
}


def model_config(hf: dict, source: str) -> dict:
    gemma3 = hf["model_type"] == "gemma3_text"
    hf = with_defaults(hf, DEFAULTS[hf["model_type"]])
    # transformers reads hidden_activation (hidden_act is not read for Gemma)
    refuse(
        hf,
        source,
        hidden_activation=lambda v: v != "gelu_pytorch_tanh",
        attention_bias=bool,
        use_bidirectional_attention=bool,
        **REFUSED,
    )
    out = shared_keys(hf, source) | dict(mlp="geglu", post_norms=True, embed_scale=True, qk_norm=gemma3)
    get = lambda key, kind, default: typed(hf, key, kind, source, default)
    out["attn_scale"] = float(get("query_pre_attn_scalar", "float+", out["head_dim"])) ** -0.5
    out["attn_softcap"] = float(get("attn_logit_softcapping", "float+", 0.0))
    out["final_softcap"] = float(get("final_logit_softcapping", "float+", 0.0))
    if gemma3:
        pattern = get("sliding_window_pattern", "int+", 6)
        types = layer_types(hf, out["n_layers"], lambda i: (i + 1) % pattern != 0, source)
        full, local = gemma3_rope(hf, source)
        out |= rope_config(full, hf, source)
        rope_config(local, hf, source)  # checked: types, partial_rotary_factor
        if local["rope_type"] != "default":
            raise UserError(
                f"{source}: config.json key 'rope_parameters.sliding_attention.rope_type' = "
                f"{shown(local['rope_type'])} is not supported (RoPE on sliding-window layers is never "
                "scaled)"
            )
        out["rope_local_theta"] = float(local["rope_theta"])
    else:
        types = layer_types(hf, out["n_layers"], lambda i: (i + 1) % 2 != 0, source)
        out |= rope_config(rope_parameters(hf, source), hf, source)
    if "local" in types and hf.get("sliding_window") is None:
        raise UserError(
            f"{source}: config.json key 'sliding_window' = None with sliding-window layers is not supported"
        )
    return out | window(hf, types, source)


def gemma3_rope(hf: dict, source: str) -> tuple[dict, dict]:
    """Gemma 3's RoPE parameters of its global and local layers, as transformers reads them:
    rope_parameters keyed by layer type ("full_attention", "sliding_attention"); rope_scaling (the
    older spelling) updates the global set; rope_theta (default 1e6) and rope_local_base_freq
    (default 1e4) fill the bases each set leaves out."""
    given = typed(hf, "rope_parameters", "dict", source, None) or {}
    if given and not {"full_attention", "sliding_attention"} & set(given):
        raise UserError(
            f"{source}: config.json key 'rope_parameters' = {shown(given)}: expected an object keyed by "
            "'full_attention' and 'sliding_attention' (Gemma 3 has RoPE parameters per layer type)"
        )
    sets = []
    for layer_type, base_key, base in (
        ("full_attention", "rope_theta", 1e6),
        ("sliding_attention", "rope_local_base_freq", 1e4),
    ):
        one = given.get(layer_type) or {}
        if not isinstance(one, dict):
            raise UserError(
                f"{source}: config.json key 'rope_parameters.{layer_type}' = {shown(one)}: expected an object"
            )
        one = dict(one)
        if layer_type == "full_attention":
            one |= typed(hf, "rope_scaling", "dict", source, None) or {}
        if one.get("rope_theta") is None:
            one["rope_theta"] = hf[base_key] if hf.get(base_key) is not None else base
        if one.get("partial_rotary_factor") is None and hf.get("partial_rotary_factor") is not None:
            one["partial_rotary_factor"] = hf["partial_rotary_factor"]
        one["rope_type"] = one.get("rope_type") or one.get("type") or "default"
        sets.append(one)
    return sets[0], sets[1]


def tensors(spec):
    return llama_like(spec, norm_kind="id+1", qk_norm=spec.attention.qk_norm, post_norms=True)


def hf_config(m) -> dict:
    gemma3 = m.family == "gemma3_text"
    out = hf_base(m, "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM")
    out |= {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _scalar(m.attn_scale),
        "attn_logit_softcapping": m.attn_softcap or None,
        "final_logit_softcapping": m.final_softcap or None,
        "sliding_window": m.sliding_window or None,
        "attention_bias": False,
        "layer_types": [("sliding_attention" if t == "local" else "full_attention") for t in m.layer_types] or None,
    }
    if gemma3:
        out["rope_parameters"] = {
            "full_attention": rope_to_hf(m),
            "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_local_theta},
        }
    else:
        out["rope_parameters"] = rope_to_hf(m)
    return out


def _scalar(scale: float):
    """query_pre_attn_scalar from our scale (scalar ** -0.5): an int where it is one, as transformers requires."""
    value = round(scale**-2, 6)
    return int(value) if value == int(value) else value
