"""`lm dpo`: direct preference optimisation (and IPO, SimPO, conservative DPO, RPO) from a trained
model on preference pairs (lm.train.pair_losses for the losses).

The reference is the init model, frozen. `dpo.reference` picks how it is held:
  live         it runs beside the policy every step: a copy of the init params in the compute
               dtype, sharded like the params, with no gradient or optimizer state; with LoRA it is
               the frozen base with the adapters off (no copy at all);
  precomputed  its log-probs are computed once, in a pass over the pairs before training, and
               fed as a per-pair field: the step holds one model.
SimPO needs no reference. Metrics carry TRL's names (rewards/chosen, rewards/margins, ...), on
the held-out pairs too; at the end the held-out metrics of the init and the tuned model are
printed, and with `pairs.eval_answers` the exact match of their greedy answers.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm import plan
from lm.data.pipeline import ready_batches
from lm.eval.answers import compare_answers
from lm.model.lora import is_adapter
from lm.model.params import merge_trees
from lm.train import pairs
from lm.train.metrics import json_default, plot_curves
from lm.train.pair_losses import DpoSettings, dpo_loss, pair_logprobs
from lm.train.setup import build_run, reference_slot

EVAL_METRICS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
                "logps/chosen", "logps/rejected", "logps/accuracies")
TABLE_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "logps/accuracies", "logps/chosen", "logps/rejected")
REF_FILE = "reference_logps.npz"


def reference_mode(config) -> str:
    """live | adapters_off | precomputed | none (see the module doc)."""
    if config.dpo.loss == "simpo":
        return "none"
    if config.dpo.reference == "precomputed":
        return "precomputed"
    return "adapters_off" if config.model.lora_rank > 0 else "live"


def plain(model):
    """The same module without adapters: the reference over a LoRA policy's frozen base."""
    return model.clone(spec=dataclasses.replace(model.spec, lora_rank=0))


def build_dpo_run(config, devices=None):
    lora, mode = config.model.lora_rank > 0, reference_mode(config)
    settings = DpoSettings.from_config(config.dpo)
    live = mode in ("live", "adapters_off")
    loss = lambda m: dpo_loss(m, settings, "live" if live else mode)  # noqa: E731
    return build_run(config, loss, devices=devices, trainable=is_adapter if lora else None,
                     frozen={"reference": reference_slot(config, lora)} if live else None)


def base_shardings(run):
    """Shardings of the init model's params: the frozen base with LoRA, else the trained params."""
    return run.base_shardings if run.trainable is not None else run.state_shardings.params


def reference_logps(run, base: dict, rows, batch_size: int) -> np.ndarray:
    """[N, 2] summed response log-probs of the init model over every pair, in one pass."""
    model, shardings = plain(run.model), base_shardings(run)
    signature = run.signature(batch_size, pairs=True, extra=pairs.PAIR_EXTRA)
    placer = run.placer(signature)
    rep = NamedSharding(run.mesh, PartitionSpec())
    fn = jax.jit(lambda p, b: pair_logprobs(model, p, b)[0], in_shardings=(shardings, run.batch_shardings(signature)),
                 out_shardings=rep)
    params = jax.device_put(base, shardings)
    out = [np.asarray(jax.device_get(fn(params, placer.from_global(b)))) for b in ready_batches(rows, batch_size)]
    return np.concatenate(out)[: len(rows)].astype(np.float32)


def _precomputed(stage, run, resume: bool) -> tuple:
    """({'ref_logps'} of the train pairs, of the held-out pairs), computed once and kept in the
    workdir (a resumed run reads them back; a fresh one computes them anew)."""
    path = stage.workdir / REF_FILE
    if resume and path.is_file():
        saved = np.load(path)
        held = saved["heldout"] if stage.heldout is not None else None
    else:
        bs = stage.config.eval.batch_size
        print(f"reference log-probs: one pass over {len(stage.train)} pairs", flush=True)
        train = reference_logps(run, stage.loaded.params, stage.train, bs)
        held = reference_logps(run, stage.loaded.params, stage.heldout, bs) if stage.heldout is not None else None
        if jax.process_index() == 0:
            stage.workdir.mkdir(parents=True, exist_ok=True)
            np.savez(path, train=train, **({"heldout": held} if held is not None else {}))
        saved = {"train": train}
    return {"ref_logps": saved["train"]}, ({"ref_logps": held} if held is not None else None)


def dpo(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    stage = pairs.prepare(config, workdir, resume, "dpo")
    if isinstance(stage, dict):
        return stage
    run = build_dpo_run(config)
    mode = reference_mode(config)
    extra, fields = None, (None, None)
    if mode == "precomputed":
        extra, fields = {"ref_logps": ((2,), np.float32)}, _precomputed(stage, run, resume)
    flops = plan.flops_per_token(config.model, config.data.seq_len)
    if mode in ("live", "adapters_off"):
        flops *= 4 / 3  # the reference's forward pass: 2N beside the policy's 6N
    state, frozen, last = pairs.train(stage, run, resume=resume, show_progress=show_progress,
                                      eval_metrics=EVAL_METRICS, extra=extra, fields=fields, flops_per_token=flops)
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"]}
    policy = merge_trees(state.params, (frozen or {}).get("base"))
    return _finish(stage, policy, last, mode)


SUMMARY_KEYS = ("loss", "tokens_per_s", "run_tokens_per_s", "run_mfu", "peak_flops_source", "compile_s")


def _finish(stage, params, last: dict, mode: str) -> dict:
    config, workdir = stage.config, stage.workdir
    before, after = pairs.first_eval(workdir), {k: v for k, v in last.items() if k.startswith("eval_")}
    summary = {"step": config.train.steps, "init": config.pairs.init, "loss_name": config.dpo.loss,
               "reference": mode, "lora_rank": config.model.lora_rank, "data": stage.train.stats,
               "eval_init": before, "eval": after} | {k: last.get(k) for k in SUMMARY_KEYS}
    n = min(config.pairs.eval_pairs, len(stage.heldout)) if stage.heldout is not None else None
    if before or after:
        print(pairs.eval_table("DPO: held-out pairs", TABLE_KEYS, before, after, n))
    p = config.pairs
    if p.eval_answers:
        summary |= compare_answers(stage.loaded, config, params, p.eval_answers, p.eval_examples,
                                   p.eval_max_new_tokens)
    if jax.process_index() == 0:
        plot_curves(workdir / "metrics.jsonl", workdir / "loss.png")
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=json_default))
    return summary
