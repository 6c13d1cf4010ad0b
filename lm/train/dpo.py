"""`lm dpo`: direct preference optimisation (and IPO, SimPO, ORPO, conservative DPO, RPO) from a
trained model on preference pairs (lm.train.pair_losses for the losses).

The reference is the init model, frozen. `dpo.reference` picks how it is held:
  live         it runs beside the policy every step: a copy of the init params in the compute
               dtype, sharded like the params, with no gradient or optimizer state; with LoRA it is
               the frozen base with the adapters off (no copy at all);
  precomputed  its log-probs are computed once, in a pass over the pairs before training, and
               fed as a per-pair field: the step holds one model. They are kept in the workdir
               with a record of the pairs and the model they came from; a resume reuses them
               only while both are the same.
SimPO and ORPO need no reference. Metrics carry TRL's names (rewards/chosen, rewards/margins, ...), on
the held-out pairs too; at the end the held-out metrics of the init and the tuned model are
printed, and with `finetune.eval_answers` the exact match of their greedy answers.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import with_values
from lm.data.pipeline import ready_batches
from lm.eval.answers import compare_answers
from lm.model import counts
from lm.model.lora import is_adapter
from lm.model.params import subtree
from lm.outputs import atomic_open
from lm.sharding import place_leaf
from lm.store.fingerprint import model_fingerprint
from lm.train import pairs
from lm.train.pair_losses import DpoSettings, dpo_loss, pair_logprobs
from lm.train.setup import build_run, reference_slot
from lm.train.stage import first_eval, run_stage

EVAL_METRICS = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "logps/accuracies",
)
TABLE_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "logps/accuracies", "logps/chosen", "logps/rejected")
REF_FILE = "reference_logps.npz"
RECORD = "record"  # the array in REF_FILE that holds reference_record as JSON


def reference_mode(config) -> str:
    """live | adapters_off | precomputed | none (see the module doc)."""
    if not DpoSettings.from_config(config.dpo).needs_reference:  # simpo, orpo
        return "none"
    if config.dpo.reference == "precomputed":
        return "precomputed"
    return "adapters_off" if config.model.lora_rank > 0 else "live"


def plain(model):
    """The same module without adapters: the reference over a LoRA policy's frozen base."""
    return model.clone(spec=model.spec.without_lora())


def build_dpo_run(config, devices=None):
    lora, mode = config.model.lora_rank > 0, reference_mode(config)
    settings = DpoSettings.from_config(config.dpo)
    live = mode in ("live", "adapters_off")
    loss = lambda m: dpo_loss(m, settings, "live" if live else mode)  # noqa: E731
    return build_run(
        config,
        loss,
        devices=devices,
        trainable=is_adapter if lora else None,
        frozen={"reference": reference_slot(config, lora)} if live else None,
    )


def base_shardings(run):
    """Shardings of the init model's params: the frozen base with LoRA, else the trained params."""
    return run.base_shardings if run.trainable is not None else run.state_shardings.params


def reference_logps(run, base: dict, rows, batch_size: int) -> np.ndarray:
    """[N, 2] summed response log-probs of the init model over every pair, in one pass."""
    model, shardings = plain(run.model), base_shardings(run)
    signature = run.signature(batch_size, pairs=True)  # the text fields only: a row's margin or label is not read
    placer = run.placer(signature)
    rep = NamedSharding(run.mesh, PartitionSpec())
    fn = jax.jit(
        lambda p, b: pair_logprobs(model, p, b)[0],
        in_shardings=(shardings, run.batch_shardings(signature)),
        out_shardings=rep,
    )
    params = jax.tree.map(place_leaf, base, subtree(shardings, base))  # shard by shard (lazy leaves too)
    batches = ({k: b[k] for k in signature} for b in ready_batches(rows, batch_size))
    out = [np.asarray(jax.device_get(fn(params, placer.from_global(b)))) for b in batches]
    return np.concatenate(out)[: len(rows)].astype(np.float32)


def _precomputed(ctx) -> tuple:
    """(ref_logps of the train pairs, of the held-out pairs or None), computed once and kept in the
    workdir with the record of what they were computed from (reference_record). A resumed run
    reads them back; it computes them again when the file is damaged or its record differs."""
    path, (train, heldout) = ctx.workdir / REF_FILE, ctx.data
    record = reference_record(ctx)
    if ctx.resume and path.is_file():
        saved = read_reference(path, len(train), len(heldout) if heldout is not None else None, record)
        if saved is not None:
            return saved
    bs, base = ctx.config.eval.batch_size, ctx.init.params
    print(f"reference log-probs: one pass over {len(train)} pairs", flush=True)
    out = reference_logps(ctx.run, base, train, bs)
    held = reference_logps(ctx.run, base, heldout, bs) if heldout is not None else None
    if ctx.is_main:
        write_reference(path, out, held, record)
    return out, held


# Model settings that leave the reference's values alone: the reference is the plain init model
# (LoRA's adapters are off), and remat or pipelining change how it runs, not what it computes.
NOT_REFERENCE = ("remat", "pipeline_microbatches")


def reference_record(ctx) -> dict:
    """What the reference log-probs follow from: the pairs they score (rows_digest, per split)
    and the reference model (its init's fingerprint and the model settings)."""
    train, heldout = ctx.data
    model = {
        f"model.{k}": v
        for k, v in ctx.config.model.to_dict().items()
        if not k.startswith("lora_") and k not in NOT_REFERENCE
    }
    record = {
        "data": {"train": rows_digest(train), "heldout": rows_digest(heldout) if heldout is not None else None},
        "model": {"finetune.init": model_fingerprint(ctx.config.finetune.init)} | model,
    }
    return json.loads(json.dumps(record))  # as it reads back (tuples as lists)


def rows_digest(rows) -> str:
    """sha256 of the pairs' arrays in order (token ids, loss weights, lengths; lm.data.preference)
    and their row length: their content, wherever the cache keeps them."""
    digest = hashlib.sha256(f"pairs seq_len {rows.seq_len}".encode())
    for name in ("tokens", "weights", "lengths"):
        array = getattr(rows, name)
        digest.update(f"{name} {array.dtype.str} {list(array.shape)}".encode())
        step = max(1, (64 << 20) // max(array[:1].nbytes, 1))  # ~64 MiB of a memory-mapped array at a time
        for start in range(0, len(array), step):
            digest.update(np.ascontiguousarray(array[start : start + step]).data)
    return digest.hexdigest()


def write_reference(path: pathlib.Path, train: np.ndarray, heldout: np.ndarray | None, record: dict) -> None:
    """The values and their record in one file, replaced whole (lm.outputs): a kill or a full disk
    never leaves half a file, nor values beside another computation's record."""
    held = {"heldout": heldout} if heldout is not None else {}
    with atomic_open(path, "wb") as f:
        np.savez(f, train=train, **held, **{RECORD: np.array(json.dumps(record))})


def read_reference(path: pathlib.Path, n_train: int, n_heldout: int | None, record: dict) -> tuple | None:
    """The saved reference log-probs if they were computed from what `record` names and fit the
    data ([pairs, 2] floats, finite), else None after a one-line warning (they are then computed
    again)."""
    want = {"train": n_train} | ({"heldout": n_heldout} if n_heldout is not None else {})
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = {k: saved[k] for k in (*want, RECORD) if k in saved.files}
    except Exception as e:  # a truncated or garbled file: zipfile, zlib, numpy format errors
        problem = f"unreadable: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    else:
        source = _other_source(arrays.get(RECORD), record, n_heldout is not None)
        if source is not None:
            print(f"lm: warning: the precomputed reference '{path}' {source}; computing it again", flush=True)
            return None
        problem = _reference_problem(arrays, want)
        if problem is None:
            held = arrays["heldout"].astype(np.float32) if n_heldout is not None else None
            return arrays["train"].astype(np.float32), held
    print(
        f"lm: warning: the precomputed reference '{path}' is damaged or does not fit the data ({problem}); "
        "computing it again",
        flush=True,
    )
    return None


def _other_source(saved, record: dict, heldout: bool) -> str | None:
    """How the saved record differs from this run's, as the end of a sentence; None if it does not."""
    if saved is None:
        return "records no fingerprint of the data and model it was computed from (an older file)"
    try:
        saved = json.loads(str(saved[()]))
        data, model = dict(saved["data"]), dict(saved["model"])
    except (ValueError, TypeError, KeyError, IndexError):
        return "has an unreadable record of the data and model it was computed from"
    splits = {"train": "train pairs"} | ({"heldout": "held-out pairs"} if heldout else {})
    other_data = [
        f"{label}: sha256 {_short(data.get(k))} (file) vs {_short(record['data'][k])} (now)"
        for k, label in splits.items()
        if data.get(k) != record["data"][k]
    ]
    now = record["model"]
    # a model setting added to the code since the file was written: its default is all it knew
    other_model = [
        f"{k}: {model.get(k, '(none)')!r} (file) vs {now.get(k, '(none)')!r} (now)"
        for k in sorted(model.keys() | now.keys())
        if model.get(k) != now.get(k) and (k in model or not k.startswith("model."))
    ]
    if not other_data and not other_model:
        return None
    what = " and ".join(w for w, d in (("other data", other_data), ("another reference model", other_model)) if d)
    return f"was computed from {what} ({'; '.join(other_data + other_model)})"


def _short(digest) -> str:
    return digest[:12] if isinstance(digest, str) else repr(digest)


def _reference_problem(arrays: dict, want: dict) -> str | None:
    for k, n in want.items():
        if k not in arrays:
            return f"no '{k}' array"
        a = arrays[k]
        if a.shape != (n, 2):
            return f"'{k}' has shape {list(a.shape)}, the data need [{n}, 2]"
        if not np.issubdtype(a.dtype, np.floating):
            return f"'{k}' has dtype {a.dtype}, not float"
        if not np.isfinite(a).all():
            return f"'{k}' holds non-finite values"
    return None


SUMMARY_KEYS = ("loss", "tokens_per_s", "run_tokens_per_s", "run_mfu", "peak_flops_source", "compile_s")


class Dpo(pairs.PairStage):
    name = "dpo"
    eval_metrics = EVAL_METRICS

    def build(self, ctx):
        return build_dpo_run(ctx.config)

    def reference_mode(self, config) -> str:
        return reference_mode(config)

    def fields(self, ctx):
        if self.reference_mode(ctx.config) != "precomputed":
            return {}, None, None
        train, held = _precomputed(ctx)
        return (
            {"ref_logps": ((2,), np.float32)},
            {"ref_logps": train},
            ({"ref_logps": held} if held is not None else None),
        )

    def flops_per_token(self, ctx):
        flops = counts.flops_per_token(ctx.config.model, ctx.config.data.seq_len)
        if self.reference_mode(ctx.config) in ("live", "adapters_off"):
            flops *= 4 / 3  # the reference's forward pass: 2N beside the policy's 6N
        return flops

    def finish(self, ctx) -> dict:
        c, last = ctx.config, ctx.last
        before, after = first_eval(ctx.workdir), {k: v for k, v in last.items() if k.startswith("eval_")}
        summary = {
            "step": c.train.steps,
            "init": c.finetune.init,
            "loss_name": c.dpo.loss,
            "beta": DpoSettings.from_config(c.dpo).loss_beta,
            "reference": reference_mode(c),
            "lora_rank": c.model.lora_rank,
            "data": ctx.data[0].stats,
            "eval_init": before,
            "eval": after,
        } | {k: last.get(k) for k in SUMMARY_KEYS}
        if before or after:
            print(pairs.eval_table("DPO: held-out pairs", TABLE_KEYS, before, after, self.held_out_pairs(ctx)))
        p = c.finetune
        if p.eval_answers:
            summary |= compare_answers(ctx.init, c, ctx.params, p.eval_answers, p.eval_examples, p.eval_max_new_tokens)
        return summary


def dpo(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Dpo(), config, workdir, resume, show_progress)


def needs_reference(config) -> bool:
    """Whether the loss reads a reference model (SimPO reads none)."""
    return DpoSettings.from_config(config.dpo).needs_reference


def compiled_step(config, devices, spec):
    """The step `lm plan` compiles (lm.train.registry): DPO with a live reference, pairs per row
    (the run's own spec: `spec` is not used)."""
    config = with_values(config, {"dpo.reference": "live"})
    run = build_dpo_run(config, devices)
    return run, run.signature(pairs=True, extra=pairs.PAIR_EXTRA)
