"""`lm demo`'s mixture-of-experts stage: a short pretraining run of the tiny model with every block's
MLP as routed experts (lm.model.moe) at the dense model's active FLOPs per token, on the demo's
data, beside the demo's dense pretraining at the same steps.

The MoE run is the dense run's config (its data, batch, seeds and learning-rate schedule: the
schedule's length stays the dense run's, so both runs see the same batches at the same learning
rate) with N_EXPERTS SwiGLU experts of width d_ff / K, K per token, dropless: a token's active MLP
width is the dense one's and only the router's d_model x N_EXPERTS weights add FLOPs.
"""

from __future__ import annotations

import json
import pathlib

from lm.config import Config, apply_overrides, freeze, thaw, validate
from lm.model import counts
from lm.store.checkpoint_read import saved_steps
from lm.store.meta import init_config
from lm.train.metrics import moe_routing, plot_runs, read_metrics
from lm.train.pretrain import train

N_EXPERTS, K = 8, 2
STEPS = 50  # ~1.2-2 s a step on 2 CPU cores: XLA:CPU has no grouped matmul (ragged_dot runs masked, per expert)


def moe_config(dense, steps: int, n_experts: int = N_EXPERTS, k: int = K) -> Config:
    """The dense run's config with experts at its active MLP width, for `steps` steps of its schedule."""
    c = thaw(dense)
    apply_overrides(
        c,
        [
            f"model.n_experts={n_experts}",
            f"model.experts_per_token={k}",
            f"model.expert_d_ff={c.model.d_ff // k}",
            "model.capacity_factor=0.0",
            f"optim.decay_steps={c.optim.decay_steps or c.train.steps}",
            f"train.steps={steps}",
            f"checkpoint.every_steps={steps}",
            f"train.sample_tokens={min(c.train.sample_tokens, 16)}",
        ],
    )
    c.train.init = ""  # a fresh model
    validate(c)
    return freeze(c)


def moe_pretraining(
    root: pathlib.Path, dense_dir: pathlib.Path, steps: int = STEPS, show_progress: bool = True, resume: bool = False
) -> dict:
    """Trains the MoE into root/pretrain-moe (resume: from its checkpoints, if any); returns its
    figures beside the dense run's at `steps`."""
    dense_dir, workdir = pathlib.Path(dense_dir), pathlib.Path(root) / "pretrain-moe"
    dense_config = init_config(str(dense_dir.absolute()))
    config = moe_config(dense_config, steps)
    train(config, workdir, resume=resume and bool(saved_steps(workdir / "checkpoints")), show_progress=show_progress)
    dense_rows, rows = read_metrics(dense_dir / "metrics.jsonl"), read_metrics(workdir / "metrics.jsonl")
    done, dense_summary = (json.loads((d / "summary.json").read_text()) for d in (workdir, dense_dir))
    m, dm = config.model, dense_config.model
    out = {
        "steps": steps,
        "n_experts": m.n_experts,
        "k": m.experts_per_token,
        "expert_d_ff": m.expert_d_ff,
        "eval_loss": _at(rows, "eval_loss", steps),
        "dense_eval_loss": _at(dense_rows, "eval_loss", steps),
        "eval_loss_init": _at(rows, "eval_loss", 0),
        "train_loss": _mean_train(rows, steps),
        "dense_train_loss": _mean_train(dense_rows, steps),
        "params": counts.param_count(m),
        "active_params": counts.active_param_count(m),
        "dense_params": counts.param_count(dm),
        "flops_ratio": counts.flops_per_token(m, config.data.seq_len) / counts.flops_per_token(dm, config.data.seq_len),
        "tokens_per_s": done.get("run_tokens_per_s"),
        "dense_tokens_per_s": dense_summary.get("run_tokens_per_s"),
        "routing": moe_routing(rows),
        "plot": str(workdir / "moe_vs_dense.png"),
    }
    plot_runs(
        {
            "dense": dense_dir / "metrics.jsonl",
            f"MoE {m.n_experts} experts x {m.expert_d_ff}, top-{m.experts_per_token}": workdir / "metrics.jsonl",
        },
        workdir / "moe_vs_dense.png",
        baseline=done.get("unigram_baseline"),
        until=steps,
        title="dense vs MoE at equal active FLOPs per token (same batches, same learning rates)",
    )
    print("\n".join(moe_lines(out)))
    return out


def _at(rows: list[dict], key: str, step: int):
    return next((r[key] for r in rows if r["step"] == step and isinstance(r.get(key), (int, float))), None)


def _mean_train(rows: list[dict], steps: int):
    """Mean logged train loss over the second half of the first `steps` steps: each row's batch is
    one neither run had trained on, and both runs read the same batches."""
    losses = [r["loss"] for r in rows if steps // 2 < r["step"] <= steps and isinstance(r.get("loss"), (int, float))]
    return sum(losses) / len(losses) if losses else None


def moe_lines(s: dict) -> list[str]:
    """The evidence table's lines for the mixture-of-experts stage."""
    g, nan = s["routing"] or {}, float("nan")
    line = (
        f"mixture of experts ({s['n_experts']} experts of width {s['expert_d_ff']}, top-{s['k']}, dropless; "
        f"{s['params']:,} params, {s['active_params']:,} active vs the dense {s['dense_params']:,}; training "
        f"FLOPs per token {s['flops_ratio']:.3f}x the dense), {s['steps']} steps: held-out loss "
    )
    if s["dense_eval_loss"] is not None:
        line += (
            f"{s['eval_loss']:.3f} vs {s['dense_eval_loss']:.3f} for the dense pretraining at step {s['steps']} "
            f"(MoE - dense {s['eval_loss'] - s['dense_eval_loss']:+.3f})"
        )
    else:
        line += f"{s['eval_loss']:.3f} (from {s['eval_loss_init'] or nan:.3f}; the dense run has none at this step)"
    if s["train_loss"] is not None and s["dense_train_loss"] is not None:
        line += (
            f"; train loss on the same batches, steps {s['steps'] // 2 + 1}-{s['steps']}: "
            f"{s['train_loss']:.3f} vs {s['dense_train_loss']:.3f}"
        )
    lines = [line]
    if g:
        lines.append(
            f"  routing at step {g['step']}: balance loss {g['balance']:.3f} (1 = even), expert load "
            f"{g['load_min']:.2f}-{g['load_max']:.2f}x an even share, router z {g['router_z']:.2f}, "
            f"{g['dropped']:.1%} of assignments dropped; tokens/s {s['tokens_per_s'] or nan:,.0f} vs the "
            f"dense run's {s['dense_tokens_per_s'] or nan:,.0f}; curves: {s['plot']}"
        )
    return lines
