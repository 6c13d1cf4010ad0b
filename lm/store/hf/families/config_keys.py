"""What the Hugging Face families share in reading and writing config.json: keys checked for their
type (`typed`, KINDS), transformers' defaults, refusing what a family does not support, RoPE
parameters in both config.json spellings, and the model-section keys every family maps the same way
(sizes, sliding windows, experts). The tensor maps and layout transforms are lm.store.hf.families.common.
"""

from __future__ import annotations

import math

from lm.errors import UserError

MISSING = object()  # a required config.json key: no default
KINDS = {  # kind -> (test, what is expected)
    "int+": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "int0": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "float": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "a finite number",
    ),
    "float+": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
        "a positive number",
    ),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "ints": (
        lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "a list of integers",
    ),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def shown(value, limit: int = 60) -> str:
    """A value as one short line of an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def typed(hf: dict, key: str, kind: str, source: str, default=MISSING, where: str = "config.json key"):
    """config.json's `key`, checked to be of `kind` (KINDS); `default` when absent or null (a
    required key, default MISSING, is refused when absent). One UserError line otherwise."""
    value = hf.get(key)
    if value is None:
        if default is MISSING:
            raise UserError(f"{source}: config.json has no '{key}' (model_type '{hf.get('model_type')}')")
        return default
    ok, expected = KINDS[kind]
    if not ok(value):
        raise UserError(f"{source}: {where} '{key}' = {shown(value)}: expected {expected}")
    return value


def with_defaults(hf: dict, defaults: dict) -> dict:
    """config.json with transformers' own defaults for the keys it leaves out (an explicit null stays)."""
    return {k: v for k, v in defaults.items() if k not in hf} | hf


def refuse(hf: dict, source: str, **unsupported) -> None:
    """One clear error naming the first config key whose value this importer cannot honour:
    unsupported = {key: predicate(value) -> True when the value is unsupported}."""
    for key, bad in unsupported.items():
        if key in hf and hf[key] is not None and bad(hf[key]):
            raise UserError(
                f"{source}: config.json key '{key}' = {shown(hf[key])} is not supported for "
                f"model_type '{hf.get('model_type')}' (the model would compute something else)"
            )


# Keys every family refuses: a quantized checkpoint holds other tensors than the weights.
REFUSED = dict(quantization_config=lambda v: True)


def rope_parameters(hf: dict, source: str, layer_type: str | None = None, theta: float = 10000.0) -> dict:
    """The RoPE parameters of a config.json as transformers standardises them: `rope_scaling` (the
    transformers-4 spelling) wins over `rope_parameters` (transformers 5), per layer type when
    nested; `rope_theta` and `partial_rotary_factor` at the top level fill what the set leaves out,
    `theta` (the family's default) after that."""
    given = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(given, dict):
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        raise UserError(f"{source}: config.json key '{key}' = {shown(given)}: expected an object")
    if layer_type is not None and layer_type in given:
        given = given[layer_type]
        if not isinstance(given, dict):
            raise UserError(
                f"{source}: config.json key 'rope_parameters.{layer_type}' = {shown(given)}: expected an object"
            )
    out = {k: v for k, v in given.items() if not isinstance(v, dict)}
    if "rope_theta" not in out or out["rope_theta"] is None:
        out["rope_theta"] = hf["rope_theta"] if hf.get("rope_theta") is not None else theta
    if "partial_rotary_factor" not in out and hf.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = hf["partial_rotary_factor"]
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


ROPE_KINDS = dict(
    rope_theta="float+",
    partial_rotary_factor="float+",
    factor="float+",
    rope_type="str",
    original_max_position_embeddings="int+",
    low_freq_factor="float+",
    high_freq_factor="float+",
    beta_fast="float",
    beta_slow="float",
    attention_factor="float",
    mscale="float",
    mscale_all_dim="float",
    truncate="bool",
)


def rope_config(rope: dict, hf: dict, source: str) -> dict:
    """Our model-section keys for one set of RoPE parameters."""
    for key, kind in ROPE_KINDS.items():
        if rope.get(key) is not None:
            typed(rope, key, kind, source, where="config.json RoPE parameter")
    kind = rope["rope_type"]
    out = dict(rope_theta=float(rope["rope_theta"]))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(
            f"{source}: config.json key 'partial_rotary_factor' = {rope['partial_rotary_factor']!r} "
            "is not supported (RoPE on part of each head; lm rotates whole heads)"
        )
    if kind == "default":
        return out | dict(rope_scaling="none")
    factor = float(rope.get("factor") or 1.0)
    if kind == "linear":
        return out | dict(rope_scaling="linear", rope_factor=factor)
    original = int(rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 8192)
    if kind == "llama3":
        return out | dict(
            rope_scaling="llama3",
            rope_factor=factor,
            rope_original_max_len=original,
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        )
    if kind == "yarn":
        if not rope.get("factor"):
            factor = hf["max_position_embeddings"] / original
        attention = rope.get("attention_factor")
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if attention is None and mscale and mscale_all:
            m = lambda s: 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0
            attention = m(mscale) / m(mscale_all)
        return out | dict(
            rope_scaling="yarn",
            rope_factor=factor,
            rope_original_max_len=original,
            rope_beta_fast=float(rope.get("beta_fast") or 32),
            rope_beta_slow=float(rope.get("beta_slow") or 1),
            rope_attention_factor=float(attention or 0.0),
            rope_truncate=bool(rope.get("truncate", True)),
        )
    raise UserError(
        f"{source}: RoPE type {shown(kind)} (config.json key 'rope_type') is not supported (supported: "
        "default, linear, llama3, yarn)"
    )


def rope_to_hf(m) -> dict:
    """Our RoPE keys as transformers 5's `rope_parameters` (one set)."""
    out = {"rope_theta": m.rope_theta}
    if m.rope_scaling == "none":
        return out | {"rope_type": "default"}
    out |= {"rope_type": m.rope_scaling, "factor": m.rope_factor}
    if m.rope_scaling == "llama3":
        out |= {
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
        }
    if m.rope_scaling == "yarn":
        out |= {
            "original_max_position_embeddings": m.rope_original_max_len,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
            "truncate": m.rope_truncate,
        }
        if m.rope_attention_factor:
            out["attention_factor"] = m.rope_attention_factor
    return out


def shared_keys(hf: dict, source: str) -> dict:
    """The model-section keys every family reads the same way (`hf` with the family's defaults), each
    checked for its type and range: sizes positive, the heads splitting the width (unless head_dim
    is given), the key/value heads splitting the heads."""
    get = lambda key, kind, default=MISSING: typed(hf, key, kind, source, default)
    d_model, n_heads = get("hidden_size", "int+"), get("num_attention_heads", "int+")
    n_kv_heads = get("num_key_value_heads", "int+", n_heads)
    head_dim = get("head_dim", "int+", 0)
    if not head_dim and d_model % n_heads:
        raise UserError(
            f"{source}: config.json key 'num_attention_heads' = {n_heads}: expected a divisor of "
            f"hidden_size={d_model} (or a head_dim)"
        )
    if n_heads % n_kv_heads:
        raise UserError(
            f"{source}: config.json key 'num_key_value_heads' = {n_kv_heads}: expected a divisor of "
            f"num_attention_heads={n_heads}"
        )
    return dict(
        vocab_size=get("vocab_size", "int+"),
        d_model=d_model,
        n_layers=get("num_hidden_layers", "int+"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim or d_model // n_heads,
        d_ff=get("intermediate_size", "int+"),
        max_seq_len=get("max_position_embeddings", "int+", 2048),
        norm_eps=float(get("rms_norm_eps", "float+", 1e-6)),
        norm="rmsnorm",
        position="rope",
        tie_embeddings=get("tie_word_embeddings", "bool", False),
        family=hf["model_type"],
    )


def layer_types(hf: dict, n_layers: int, default, source: str = "config.json") -> tuple:
    """Per layer 'global'/'local' from config.json's layer_types, else default(i) -> local?."""
    given = typed(hf, "layer_types", "strs", source, None)
    if given:
        if len(given) != n_layers or not set(given) <= {"full_attention", "sliding_attention"}:
            raise UserError(
                f"{source}: config.json key 'layer_types' = {shown(given)}: expected {n_layers} names "
                "among 'full_attention', 'sliding_attention'"
            )
        return tuple("local" if t == "sliding_attention" else "global" for t in given)
    return tuple("local" if default(i) else "global" for i in range(n_layers))


def window(hf: dict, types: tuple, source: str) -> dict:
    """Our sliding-window keys for per-layer `types`: none when every layer is global."""
    if "local" not in types:
        return {}
    return dict(sliding_window=typed(hf, "sliding_window", "int+", source), layer_types=types)


def hf_base(m, architecture: str) -> dict:
    """The config.json keys every family writes the same way, from our model section."""
    return {
        "architectures": [architecture],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim or m.d_model // m.n_heads,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
    }


def moe_keys(hf: dict, source: str, experts: int, width_key: str, router_norm: bool) -> dict:
    """Our MoE keys from a config.json: the number of experts (num_local_experts, or num_experts:
    transformers reads both spellings as one; `experts` when neither is given), experts per token,
    each expert's width (width_key), softmax routing over all experts, dropless;
    router_aux_loss_coef weighs the balance loss."""
    spelled = {k: hf[k] for k in ("num_local_experts", "num_experts") if hf.get(k) is not None}
    if len(set(map(repr, spelled.values()))) > 1:
        raise UserError(
            f"{source}: config.json keys 'num_local_experts' = {spelled['num_local_experts']!r:.20} and "
            f"'num_experts' = {spelled['num_experts']!r:.20} differ (transformers reads them as one)"
        )
    experts_key = next(iter(spelled), "num_local_experts" if "num_local_experts" in hf else "num_experts")
    given = {
        experts_key: next(iter(spelled.values()), None if experts_key in hf else experts),
        "num_experts_per_tok": hf.get("num_experts_per_tok"),
        width_key: hf.get(width_key),
    }
    for key, value in given.items():
        if not KINDS["int+"][0](value):
            raise UserError(
                f"{source}: config.json has no positive '{key}' (model_type '{hf.get('model_type')}'; "
                f"found {shown(value)})"
            )
    if given["num_experts_per_tok"] > given[experts_key]:
        raise UserError(
            f"{source}: config.json key 'num_experts_per_tok' = {given['num_experts_per_tok']}: expected "
            f"at most {experts_key}={given[experts_key]}"
        )
    out = dict(
        n_experts=given[experts_key],
        experts_per_token=given["num_experts_per_tok"],
        expert_d_ff=given[width_key],
        shared_d_ff=0,
        router_score="softmax",
        router_norm=bool(router_norm),
        capacity_factor=0.0,
    )
    coef = typed(hf, "router_aux_loss_coef", "float", source, None)
    if coef is not None:
        if coef < 0:
            raise UserError(f"{source}: config.json key 'router_aux_loss_coef' = {coef}: expected >= 0")
        out["moe_balance_coef"] = float(coef)
    return out
