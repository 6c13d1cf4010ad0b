"""`lm demo`: the whole pipeline on the tiny model, with the evidence that each stage helped.

1. pretraining on the Python standard library (held-out loss against the unigram baseline);
2. the sort task (lm.data.synthetic) as chat JSONL, with a held-out split;
3. supervised fine-tuning from the pretrained model, fully and with LoRA adapters;
4. one table: held-out response loss and exact-match accuracy of greedy answers, base vs SFT
   vs SFT-LoRA; written to WORKDIR/demo_summary.json as well.
"""

from __future__ import annotations

import json
import pathlib

from lm.config import load_config, sft_config
from lm.data.synthetic import write_sort_task
from lm.infer.load import init_config

PRETRAIN_CONFIG, SFT_CONFIG = "configs/tiny.py", "configs/sft_tiny.py"
LORA = ["model.lora_rank=8", "model.lora_alpha=16.0", "optim.lr=1e-2", "sft.epochs=1.5"]


def _stage(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run_demo(workdir, show_progress: bool = True, pretrain_overrides=(), sft_overrides=(),
             n_train: int = 20000, n_heldout: int = 256) -> dict:
    from lm.train.pretrain import train  # lazy: jax after the CPU flags are set
    from lm.train.sft import sft

    root = pathlib.Path(workdir)
    base_dir, task_dir = root / "pretrain", root / "task"
    _stage("1. pretraining on the Python standard library")
    base = train(load_config(PRETRAIN_CONFIG, list(pretrain_overrides)), base_dir, show_progress=show_progress)
    _stage("2. the sort task: 'sort 70931' -> '01379'")
    paths = write_sort_task(task_dir, n_train=n_train, n_heldout=n_heldout)
    print(f"wrote {n_train} training and {n_heldout} held-out conversations to {task_dir}")
    runs = {}
    for name, extra in (("sft", []), ("sft-lora", LORA)):
        _stage(f"3. supervised fine-tuning ({name})")
        config = sft_config(init_config(str(base_dir.absolute())), SFT_CONFIG, [*extra, *sft_overrides],
                            init=str(base_dir.absolute()), data=str(paths["train"]), eval_data=str(paths["heldout"]))
        runs[name] = sft(config, root / name, show_progress=show_progress)
    summary = {"pretrain": {k: base.get(k) for k in ("eval_loss", "unigram_baseline", "run_tokens_per_s")},
               "sft": {name: _row(r) for name, r in runs.items()}}
    summary["sft"] = {"base": {"response_loss": runs["sft"].get("eval_loss_init"),
                               "exact_match": runs["sft"].get("exact_match_init")}} | summary["sft"]
    text = evidence(summary, n_heldout)
    print("\n" + text)
    (root / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    (root / "demo_summary.txt").write_text(text + "\n")
    return summary


def _row(r: dict) -> dict:
    return {"response_loss": r.get("eval_loss"), "exact_match": r.get("exact_match"), "steps": r.get("step"),
            "tokens_per_s": r.get("run_tokens_per_s")}


def evidence(summary: dict, n_heldout: int) -> str:
    p = summary["pretrain"]
    lines = ["=== evidence ===",
             f"pretraining: held-out loss {p['eval_loss']:.3f} nats/token vs {p['unigram_baseline']:.3f} for the "
             "unigram baseline",
             f"sort task, {n_heldout} held-out prompts, greedy answers with the chat template:",
             f"  {'model':<10} {'response loss':>14} {'exact match':>12}"]
    for name, row in summary["sft"].items():
        loss = f"{row['response_loss']:.4f}" if row["response_loss"] is not None else "-"
        acc = f"{row['exact_match']:.1%}" if row["exact_match"] is not None else "-"
        lines.append(f"  {name:<10} {loss:>14} {acc:>12}")
    return "\n".join(lines)
