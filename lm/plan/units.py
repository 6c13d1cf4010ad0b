"""`lm plan`'s summary of a model (lm.model.counts in a small table) and the units its figures are shown in."""

from __future__ import annotations

from lm.model.counts import (
    active_param_count,
    chinchilla_tokens,
    expert_params,
    flops_per_token,
    n_experts,
    non_embedding_params,
    param_breakdown,
    param_count,
)


def _human(x: float, units=("T", "B", "M", "K", "")) -> str:
    """x in the largest of 1e12, 1e9, 1e6, 1e3, 1 it reaches, named by `units`."""
    for unit, scale in zip(units, (1e12, 1e9, 1e6, 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}{units[-1]}"


def summary(m, seq_len: int, train_tokens: int | None = None) -> str:
    """A small human-readable table of parameters, FLOPs/token and token budget; for a mixture of
    experts, total and active params and the bytes of the expert weights. With `train_tokens` (a
    run's train.steps x train.batch_size x data.seq_len), its tokens per (total) param."""
    rows = [(k, f"{v:,}") for k, v in param_breakdown(m).items()]
    total = f"{param_count(m):,} ({_human(param_count(m))})"
    if n_experts(m):
        active = active_param_count(m)
        total += f" total, {active:,} ({_human(active)}) active ({m.experts_per_token} of {n_experts(m)} experts)"
        dtype = getattr(m, "compute_dtype", "float32")
        itemsize = 2 if dtype == "bfloat16" else 4
        experts = expert_params(m)
        rows.append(
            (
                "expert weights",
                f"{human_bytes(4 * experts)} float32 (training), "
                f"{human_bytes(itemsize * experts)} {dtype}; split over mesh.expert",
            )
        )
    rows += [
        ("total", total),
        ("non-embedding", f"{non_embedding_params(m):,} ({_human(non_embedding_params(m))})"),
        (f"FLOPs/token @{seq_len}", f"{flops_per_token(m, seq_len):.3e}"),
        ("chinchilla tokens", _human(chinchilla_tokens(m))),
    ]
    if train_tokens is not None:
        rows += [
            ("train tokens", f"{train_tokens:,} ({_human(train_tokens)})"),
            ("tokens/param", f"{train_tokens / param_count(m):.1f} (Chinchilla's compute-optimal: ~20)"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    return _human(n, ("TB", "GB", "MB", "KB", "B"))
