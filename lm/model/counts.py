"""The model's counts: parameters, FLOPs per token and compute-optimal tokens.

Pure functions over the model section of a config (a config section or any object
with the attributes used below). Nothing here builds a model or imports jax, so these
numbers can be checked against published figures before paying for a run.
"""

from __future__ import annotations

_MLP_MATRICES = {"swiglu": 3, "gelu": 2}  # gate/up/down vs fc/proj
SWIGLU = 3  # every expert (and a shared expert) is a SwiGLU: gate, up, down


def head_dim(m) -> int:
    """Per-head width; 0 in the model section means derive it as d_model // n_heads."""
    return m.head_dim or m.d_model // m.n_heads


def expert_d_ff(m) -> int:
    """Each expert's hidden width; 0 in the model section means d_ff."""
    return m.expert_d_ff or m.d_ff


def _attn_matrix_params(m) -> int:
    q_out = m.n_heads * head_dim(m)
    kv_out = m.n_kv_heads * head_dim(m)
    # q and o are d x q_out; k and v are d x kv_out each (GQA shrinks only k/v).
    return 2 * m.d_model * q_out + 2 * m.d_model * kv_out


def _mlp_matrix_params(m) -> int:
    if m.mlp not in _MLP_MATRICES:
        raise ValueError(f"unknown mlp {m.mlp!r}")
    return _MLP_MATRICES[m.mlp] * m.d_model * m.d_ff


def n_experts(m) -> int:
    """Routed experts per block; 0 for a dense MLP (configs from before mixture of experts have none)."""
    return getattr(m, "n_experts", 0) or 0


def _moe_params(m) -> dict[str, int]:
    """One block's mixture-of-experts params by group (lm.model.moe): the router [d, E], every
    expert's gate/up/down [E, d, F] and the shared dense SwiGLU of width shared_d_ff if any."""
    d, e = m.d_model, n_experts(m)
    return {
        "router": d * e,
        "experts": e * SWIGLU * d * expert_d_ff(m),
        "shared mlp": SWIGLU * d * getattr(m, "shared_d_ff", 0),
    }


def _active_ffn_matrix_params(m) -> int:
    """One block's feed-forward weights a token multiplies: the dense MLP, or the router, its
    experts_per_token experts and the shared expert."""
    if not n_experts(m):
        return _mlp_matrix_params(m)
    moe = _moe_params(m)
    return moe["router"] + moe["experts"] * m.experts_per_token // n_experts(m) + moe["shared mlp"]


def _norm_params(m, width: int | None = None) -> int:
    """One norm's params over `width` features (default d_model)."""
    width = m.d_model if width is None else width
    if m.norm == "rmsnorm":
        return width
    if m.norm == "layernorm":
        return width * (2 if m.use_bias else 1)
    raise ValueError(f"unknown norm {m.norm!r}")


def _all_norm_params(m) -> int:
    """Two norms per block (four with post_norms), the final one, and with qk_norm one over
    head_dim on queries and one on keys per block."""
    per_block = (4 if m.post_norms else 2) * _norm_params(m)
    per_block += 2 * _norm_params(m, head_dim(m)) if m.qk_norm else 0
    return m.n_layers * per_block + _norm_params(m)


def param_breakdown(m) -> dict[str, int]:
    """Trainable parameters by group; the values sum to param_count(m). A mixture-of-experts
    model has router, experts and shared mlp (if any) where a dense one has mlp."""
    hd, L = head_dim(m), m.n_layers
    attn = _attn_matrix_params(m)
    mlp = 0 if n_experts(m) else _mlp_matrix_params(m)
    if m.use_bias:
        # One bias per output feature: q, k, v outputs, then o back to d_model.
        attn += (m.n_heads + 2 * m.n_kv_heads) * hd + m.d_model
        # Every MLP matrix but the last maps into d_ff; the last maps into d_model.
        if not n_experts(m):
            mlp += (_MLP_MATRICES[m.mlp] - 1) * m.d_ff + m.d_model
    if m.position == "learned":
        position = m.max_seq_len * m.d_model
    elif m.position == "rope":
        position = 0  # rotary embeddings have no parameters
    else:
        raise ValueError(f"unknown position {m.position!r}")
    ffn = {"mlp": L * mlp}
    if n_experts(m):
        ffn = {k: L * v for k, v in _moe_params(m).items() if v or k != "shared mlp"}
    return {
        "embedding": m.vocab_size * m.d_model,
        "position": position,
        "attention": L * attn,
        **ffn,
        "norms": _all_norm_params(m),
        "head": 0 if m.tie_embeddings else m.d_model * m.vocab_size,
    }


def param_count(m) -> int:
    """Total trainable parameters (a tied head is counted once)."""
    return sum(param_breakdown(m).values())


def active_param_count(m) -> int:
    """Params one token uses: the total less the routed experts it is not sent to (each token
    takes experts_per_token of n_experts; the router and a shared expert count whole). Equal to
    param_count for a dense model."""
    if not n_experts(m):
        return param_count(m)
    experts = param_breakdown(m)["experts"]
    return param_count(m) - experts + experts * m.experts_per_token // n_experts(m)


def expert_params(m) -> int:
    """The routed experts' weights (0 for a dense model): what the expert axis splits."""
    return param_breakdown(m).get("experts", 0)


def non_embedding_params(m) -> int:
    """Everything except the token and position tables (a tied head is embedding)."""
    b = param_breakdown(m)
    return param_count(m) - b["embedding"] - b["position"]


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len.

    PaLM (appendix B) / nanoGPT convention. N_matmul counts only weights used in
    matmuls: every block's projection/MLP matrices plus the d_model x vocab output
    head (even when tied, since the logits matmul is still done). Embedding lookups,
    position tables, norms and biases are excluded. The 6 = 2 (forward multiply-add)
    x 3 (forward + backward). The attention term covers QK^T and AV over the full
    seq_len with no discount for the causal mask, matching PaLM's MFU accounting.
    A mixture-of-experts block counts the weights a token is multiplied by (the router, its
    experts_per_token experts, the shared expert), not every expert's: the MFU of an MoE run.
    """
    n_matmul = m.n_layers * (_attn_matrix_params(m) + _active_ffn_matrix_params(m))
    n_matmul += m.d_model * m.vocab_size
    attn = 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return float(6 * n_matmul + attn)


def chinchilla_tokens(m) -> int:
    """Compute-optimal training tokens per Hoffmann et al. (2022): ~20 per parameter."""
    return 20 * param_count(m)
