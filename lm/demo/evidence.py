"""The demo's evidence table: the figures of lm.demo.pipeline's summary as text, one section per
stage (pretraining against the unigram baseline, held-out response loss and exact match of every
model, the preference and RL evidence, the rest of post-training (KTO, ORPO, RFT, QLoRA), the
evaluation suite's table, distillation, the TPU plan, the
Hugging Face export, serving, the mixture of experts, tool use and asynchronous GRPO).
"""

from __future__ import annotations

import pathlib

from lm.demo.agent import staleness_lines, tool_use_lines
from lm.demo.moe import moe_lines
from lm.demo.posttrain import post_training_lines
from lm.demo.scale import scale_lines
from lm.demo.serve import serving_lines


def recipe_comparison(base_dir: pathlib.Path, old_dir: pathlib.Path, old: dict) -> dict:
    """The old recipe's figures beside the default's, and both runs' curves in one plot."""
    from lm.train.metrics import plot_runs

    plot = base_dir / "recipe_vs_old.png"
    plot_runs(
        {"Muon + WSD + QK-norm (default)": base_dir / "metrics.jsonl", "AdamW + cosine": old_dir / "metrics.jsonl"},
        plot,
        baseline=old.get("unigram_baseline"),
        title="pretraining: the default recipe vs the old one (same data, batches and steps)",
    )
    return {"eval_loss": old.get("eval_loss"), "plot": str(plot)}


def _recipe_lines(p: dict) -> list[str]:
    old = p.get("old_recipe")
    if not old or old.get("eval_loss") is None:
        return []
    gap = old["eval_loss"] - p["eval_loss"]
    return [
        f"  recipe: Muon + warmup-stable-decay + QK-norm {p['eval_loss']:.3f} vs the old AdamW + warmup-cosine "
        f"{old['eval_loss']:.3f} at the same step (the default {abs(gap):.3f} nats/token "
        f"{'lower' if gap >= 0 else 'higher'}); curves: {old['plot']}"
    ]


def evidence(summary: dict, n_heldout: int) -> str:
    p = summary["pretrain"]
    lines = [
        "=== evidence ===",
        f"pretraining: held-out loss {p['eval_loss']:.3f} nats/token vs {p['unigram_baseline']:.3f} for the "
        "unigram baseline",
        *_recipe_lines(p),
        f"sort task, {n_heldout} held-out prompts, greedy answers with the chat template:",
        f"  {'model':<10} {'response loss':>14} {'exact match':>12}",
    ]
    for name, row in summary["sft"].items():
        loss = f"{row['response_loss']:.4f}" if row["response_loss"] is not None else "-"
        acc = f"{row['exact_match']:.1%}" if row["exact_match"] is not None else "-"
        lines.append(f"  {name:<10} {loss:>14} {acc:>12}")
    if "preference" in summary:
        lines += _preference_lines(summary["preference"], n_heldout)
    if "rl" in summary:
        lines += _rl_lines(summary["rl"], n_heldout)
    if summary.get("post"):
        lines += post_training_lines(summary["post"])
    if "eval" in summary:
        from lm.eval.suite import table

        lines.append(table(summary["eval"]))
    if "distill" in summary:
        lines += _distill_lines(summary["distill"], (summary.get("eval") or {}).get("distilled_vs_sft_half"))
    if summary.get("tpu"):
        t = summary["tpu"]
        lines.append(
            f"TPU {t['slice']} (compiled here by the TPU compiler, no TPU): the pretraining step needs "
            f"{t['compiled_bytes'] / 2**20:.1f} MiB a chip; the planner said {t['planned_bytes'] / 2**20:.1f} MiB"
        )
    if "hf" in summary:
        h = summary["hf"]
        lines.append(
            f"Hugging Face export (GRPO model as {h['architecture']}): transformers' greedy answers equal "
            f"lm sample's on {h['same_answers']} of {h['n']} held-out prompts (prompt ids from "
            f"apply_chat_template equal ours on {h['same_prompt_ids']})"
        )
    if "serve" in summary:
        lines += serving_lines(summary["serve"])
    if summary.get("moe"):
        lines += moe_lines(summary["moe"])
    if summary.get("agent"):
        lines += tool_use_lines(summary["agent"])
    if summary.get("async_rl"):
        lines += staleness_lines(summary["async_rl"])
    lines += scale_lines(summary.get("scale") or {})
    return "\n".join(lines)


def _rl_lines(r: dict, n: int) -> list[str]:
    before, after = (r.get("eval_init") or {}), (r.get("eval") or {})
    nan = float("nan")
    return [
        f"GRPO, {n} held-out prompts, greedy: reward (exact answer) {before.get('eval_reward', nan):.1%} -> "
        f"{after.get('eval_reward', nan):.1%}; last step: rollout reward {r.get('reward') or nan:.3f}, "
        f"KL to the SFT model {r.get('kl') or nan:.4f}, sampling {r.get('sampling_share') or nan:.0%} of the "
        f"step; curves: {r.get('plot')}"
    ]


def _preference_lines(pref: dict, n: int) -> list[str]:
    d, r = pref["dpo"], pref["reward"]
    get = lambda row, key: (row or {}).get(f"eval_{key}", float("nan"))
    return [
        f"preference, {n} held-out pairs (answer vs a plausible wrong one):",
        f"  {'':<32} {'SFT model':>10} {'after DPO':>10}",
        f"  {'log p(chosen) > log p(rejected)':<32} {get(d['init'], 'logps/accuracies'):>10.1%} "
        f"{get(d['tuned'], 'logps/accuracies'):>10.1%}",
        f"  {'mean log p(chosen)':<32} {get(d['init'], 'logps/chosen'):>10.3f} "
        f"{get(d['tuned'], 'logps/chosen'):>10.3f}",
        f"  {'mean log p(rejected)':<32} {get(d['init'], 'logps/rejected'):>10.3f} "
        f"{get(d['tuned'], 'logps/rejected'):>10.3f}",
        f"  {'implicit reward accuracy':<32} {'-':>10} {get(d['tuned'], 'rewards/accuracies'):>10.1%}",
        f"  {'implicit reward margin':<32} {get(d['init'], 'rewards/margins'):>10.3f} "
        f"{get(d['tuned'], 'rewards/margins'):>10.3f}",
        f"reward model (Bradley-Terry, from the SFT model): held-out accuracy {get(r['tuned'], 'accuracy'):.1%}, "
        f"mean margin {get(r['tuned'], 'margin'):.3f} (untrained head: {get(r['init'], 'accuracy'):.1%})",
    ]


def _distill_lines(d: dict, vs: dict | None) -> list[str]:
    nan = float("nan")
    line = (
        f"distillation (student d_model 64, teacher: the GRPO model, d_model 128; {d.get('steps')} steps, as "
        f"SFT alone): held-out top-1 agreement with the teacher {d.get('top1_agreement') or nan:.1%}, "
        f"response loss {d.get('response_loss') or nan:.4f}"
    )
    if vs:
        line += (
            f"; exact match distilled - SFT alone: {100 * vs['diff']:+.1f} pts "
            f"[{100 * vs['ci95'][0]:+.1f}, {100 * vs['ci95'][1]:+.1f}]"
        )
    return [line]
