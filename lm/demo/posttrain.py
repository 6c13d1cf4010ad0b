"""The demo's other post-training runs, beside SFT -> DPO -> GRPO on the same task and data:

- KTO from the SFT model on the preference pairs split into unpaired examples (each pair's answer
  labelled good, its plausible wrong one bad);
- ORPO from the pretrained model on the pairs: one stage where the others take SFT, then DPO;
- rejection-sampling fine-tuning from the SFT model: 4 samples for each of 2,000 training prompts,
  kept when the task's exact-answer verifier accepts them;
- QLoRA: LoRA SFT from the pretrained model over its 4-bit (NF4) base, beside LoRA SFT over the
  float base (the `sft-lora` run), with the bytes each holds for the frozen base.

Each is a run of its own under the demo's root (kto/, orpo/, rft/, sft-qlora/); the evaluation
stage scores them with the others (exact match vs SFT with bootstrap intervals).
"""

from __future__ import annotations

import pathlib

from lm.data.unpaired import unpaired_from_pairs
from lm.store.meta import init_config
from lm.train.finetune import finetune_config

PAIRS_CONFIG, SFT_CONFIG = "configs/pairs_tiny.py", "configs/sft_tiny.py"
# KTO and RFT start from a model that already answers 9 in 10 right: small steps (at the pairs'
# and SFT configs' rates both lowered its exact match); desirable 4/3 of undesirable, as KTO advises
KTO = ["finetune.epochs=0.5", "optim.lr=3e-5", "kto.desirable_weight=1.33", "finetune.eval_max_new_tokens=16"]
ORPO = [
    "dpo.loss=orpo",
    "dpo.rpo_alpha=0.0",
    "dpo.beta=0.1",
    "optim.lr=1e-3",
    "finetune.epochs=2.0",
    "finetune.eval_max_new_tokens=16",
]
RFT = [
    "rft.samples=4",
    "rft.max_new_tokens=16",
    "rft.prompts=2000",
    "rft.batch_prompts=250",
    "rl.rewards=lm.data.synthetic:sort_reward",
    "optim.lr=1e-4",
    "finetune.epochs=2.0",
]
QLORA = [
    "model.lora_rank=8",
    "model.lora_alpha=16.0",
    "optim.lr=1e-2",
    "finetune.epochs=1.5",
    "model.lora_base_quant=nf4",
]
MODELS = ("kto", "orpo", "rft", "sft-qlora")


def post_training(stages, root: pathlib.Path, paths: dict, pair_paths: dict, sft_overrides, pair_overrides) -> dict:
    """Trains the runs (each a stage of the demo, resumable as the others); their summaries."""
    from lm.train.dpo import dpo
    from lm.train.kto import kto
    from lm.train.rft import rft
    from lm.train.sft import sft

    base_dir, sft_dir = str((root / "pretrain").absolute()), str((root / "sft").absolute())
    answers = str(paths["heldout"])
    out = {}
    stages.start(9, "kto", "KTO from the SFT model: the pairs split into unpaired good and bad answers")
    unpaired = {split: root / "task" / f"unpaired_{split}.jsonl" for split in ("train", "heldout")}
    for split, path in unpaired.items():
        unpaired_from_pairs(pair_paths[split], path)
    config = finetune_config(
        init_config(sft_dir),
        PAIRS_CONFIG,
        [*KTO, *pair_overrides],
        "kto",
        init=sft_dir,
        data=str(unpaired["train"]),
        eval_data=str(unpaired["heldout"]),
        eval_answers=answers,
    )
    out["kto"] = stages.train(kto, config, root / "kto")
    stages.start(9, "orpo", "ORPO from the pretrained model: one stage instead of SFT, then DPO")
    config = finetune_config(
        init_config(base_dir),
        PAIRS_CONFIG,
        [*ORPO, *pair_overrides],
        "dpo",
        init=base_dir,
        data=str(pair_paths["train"]),
        eval_data=str(pair_paths["heldout"]),
        eval_answers=answers,
    )
    out["orpo"] = stages.train(dpo, config, root / "orpo")
    stages.start(9, "rft", "rejection-sampling fine-tuning from the SFT model, kept by the exact-answer verifier")
    config = finetune_config(
        init_config(sft_dir),
        SFT_CONFIG,
        [*RFT, *sft_overrides],
        "rft",
        init=sft_dir,
        data=str(paths["train"]),
        eval_data=answers,
    )
    out["rft"] = stages.train(rft, config, root / "rft")
    stages.start(9, "qlora", "QLoRA: LoRA fine-tuning over the pretrained model held in 4 bits (NF4)")
    config = finetune_config(
        init_config(base_dir),
        SFT_CONFIG,
        [*QLORA, *sft_overrides],
        init=base_dir,
        data=str(paths["train"]),
        eval_data=answers,
    )
    out["sft-qlora"] = stages.train(sft, config, root / "sft-qlora") | {"base_bytes": base_bytes(base_dir)}
    return out


def base_bytes(init: str) -> dict:
    """The bytes of a model's params as a LoRA run holds its frozen base: as saved, and in NF4."""
    from lm.config import rules_table
    from lm.model.build import build_model
    from lm.model.quant import quantize_base, weight_bytes
    from lm.store.load import load_init

    loaded = load_init(init)
    built = build_model(loaded.config, rules=rules_table(loaded.config))
    return {
        "float32": weight_bytes(loaded.params)["all"],
        "nf4": weight_bytes(quantize_base(built, loaded.params, "nf4"))["all"],
    }


def post_training_lines(runs: dict) -> list[str]:
    """The evidence table's section: each run's exact match before and after, and what RFT kept."""
    nan = float("nan")
    lines = ["the rest of post-training (exact match of greedy answers on the held-out prompts, init -> tuned):"]
    for name, label in (("kto", "KTO from SFT"), ("orpo", "ORPO from the base"), ("rft", "RFT from SFT")):
        r = runs.get(name) or {}
        lines.append(
            f"  {label:<20} {r.get('exact_match_init', nan):>7.1%} -> {r.get('exact_match', nan):>7.1%}"
            f"  ({r.get('step')} steps)"
        )
    q, lora = runs.get("sft-qlora") or {}, runs.get("sft-lora") or {}
    if q:
        b = q.get("base_bytes") or {}
        lines.append(
            f"  QLoRA SFT (NF4 base)  {q.get('exact_match_init', nan):>7.1%} -> {q.get('exact_match', nan):>7.1%}"
            f"  (LoRA over the float base: {lora.get('exact_match', nan):.1%}); the frozen base "
            f"{b.get('float32', 0) / 1e6:.2f} MB in float32, {b.get('nf4', 0) / 1e6:.2f} MB in NF4"
        )
    report = (runs.get("rft") or {}).get("rft") or {}
    if report:
        lines.append(
            f"  RFT kept a sample for {report['kept']} of {report['prompts']} prompts ({report['kept_share']:.1%}); "
            f"mean verifier reward {report['reward']['mean']:.3f} over the {report['samples']} samples"
        )
    return lines
