"""Back-of-envelope planning: parameter counts, FLOPs, tokens and memory.

Pure functions over the model section of a config (a ConfigDict or any object
with the attributes used below). Nothing here builds a model, so these numbers
can be checked against published figures before paying for a run.
"""

from __future__ import annotations

from lm.config.model import head_dim

_MLP_MATRICES = {"swiglu": 3, "gelu": 2}  # gate/up/down vs fc/proj


def _attn_matrix_params(m) -> int:
    q_out = m.n_heads * head_dim(m)
    kv_out = m.n_kv_heads * head_dim(m)
    # q and o are d x q_out; k and v are d x kv_out each (GQA shrinks only k/v).
    return 2 * m.d_model * q_out + 2 * m.d_model * kv_out


def _mlp_matrix_params(m) -> int:
    if m.mlp not in _MLP_MATRICES:
        raise ValueError(f"unknown mlp {m.mlp!r}")
    return _MLP_MATRICES[m.mlp] * m.d_model * m.d_ff


def _norm_params(m) -> int:
    if m.norm == "rmsnorm":
        return m.d_model
    if m.norm == "layernorm":
        return m.d_model * (2 if m.use_bias else 1)
    raise ValueError(f"unknown norm {m.norm!r}")


def param_breakdown(m) -> dict[str, int]:
    """Trainable parameters by group; the values sum to param_count(m)."""
    hd, L = head_dim(m), m.n_layers
    attn = _attn_matrix_params(m)
    mlp = _mlp_matrix_params(m)
    if m.use_bias:
        # One bias per output feature: q, k, v outputs, then o back to d_model.
        attn += (m.n_heads + 2 * m.n_kv_heads) * hd + m.d_model
        # Every MLP matrix but the last maps into d_ff; the last maps into d_model.
        mlp += (_MLP_MATRICES[m.mlp] - 1) * m.d_ff + m.d_model
    if m.position == "learned":
        position = m.max_seq_len * m.d_model
    elif m.position == "rope":
        position = 0  # rotary embeddings have no parameters
    else:
        raise ValueError(f"unknown position {m.position!r}")
    return {
        "embedding": m.vocab_size * m.d_model,
        "position": position,
        "attention": L * attn,
        "mlp": L * mlp,
        "norms": (2 * L + 1) * _norm_params(m),  # two per block + final norm
        "head": 0 if m.tie_embeddings else m.d_model * m.vocab_size,
    }


def param_count(m) -> int:
    """Total trainable parameters (a tied head is counted once)."""
    return sum(param_breakdown(m).values())


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
    """
    n_matmul = m.n_layers * (_attn_matrix_params(m) + _mlp_matrix_params(m))
    n_matmul += m.d_model * m.vocab_size
    attn = 12 * m.n_layers * m.n_heads * head_dim(m) * seq_len
    return float(6 * n_matmul + attn)


def chinchilla_tokens(m) -> int:
    """Compute-optimal training tokens per Hoffmann et al. (2022): ~20 per parameter."""
    return 20 * param_count(m)


def _human(x: float, units=("T", "B", "M", "K", "")) -> str:
    """x in the largest of 1e12, 1e9, 1e6, 1e3, 1 it reaches, named by `units`."""
    for unit, scale in zip(units, (1e12, 1e9, 1e6, 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}{units[-1]}"


def summary(m, seq_len: int) -> str:
    """A small human-readable table of parameters, FLOPs/token and token budget."""
    rows = [(k, f"{v:,}") for k, v in param_breakdown(m).items()]
    rows += [
        ("total", f"{param_count(m):,} ({_human(param_count(m))})"),
        ("non-embedding", f"{non_embedding_params(m):,} ({_human(non_embedding_params(m))})"),
        (f"FLOPs/token @{seq_len}", f"{flops_per_token(m, seq_len):.3e}"),
        ("chinchilla tokens", _human(chinchilla_tokens(m))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    return _human(n, ("TB", "GB", "MB", "KB", "B"))
