"""`lm train`: checks -> run set-up -> data -> sharded state -> loop -> checkpoints, metrics, plot, sample.

Everything the run writes lives under `workdir`; prepared data (curated text, tokenizer, token
shards) lives in the shared data cache and is reused by every run with the same inputs.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax

from lm import plan
from lm.data.cache import data_cache_dir
from lm.data.checks import check_data_config
from lm.data.pipeline import eval_batches, train_dataset
from lm.data.prepare import describe, prepare_pretrain_data
from lm.errors import UserError
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete
from lm.perf import measure_matmul_peak
from lm.train.checkpoint import Checkpointer, saved_steps
from lm.train.faults import FaultPolicy, StopSignal
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.metrics import MetricsWriter, plot_curves, truncate_after
from lm.train.setup import build_run


def _load_data(config, progress: bool):
    d = config.data
    return prepare_pretrain_data(d, data_cache_dir(d), vocab_size=config.model.vocab_size, progress=progress,
                                 curate_cfg=config.curate)


def _evaluator(eval_fn, batches, placer):
    """Held-out loss over fixed batches; each process feeds the rows its devices hold."""

    def evaluate(state):
        total, count = 0.0, 0.0
        for batch in batches:
            stats = jax.device_get(eval_fn(state.params, placer.from_global(batch)))
            total, count = total + float(stats["loss_sum"]), count + float(stats["count"])
        return {"eval_loss": total / max(count, 1.0), "eval_tokens": count}

    return evaluate


def _check_resume(directory: pathlib.Path, resume: bool, total_steps: int) -> int | None:
    """--resume needs a checkpoint and a fresh run must not find one: checked before any data work.

    Returns the final step when the run already reached `total_steps` (nothing left to do).
    """
    steps = saved_steps(directory)
    if resume and not steps:
        raise UserError(f"--resume: no checkpoint in '{directory}'; run without --resume to start fresh")
    if not resume and steps:
        raise UserError(f"'{directory.parent}' already holds checkpoints (steps {steps[0]}..{steps[-1]}); "
                        "pass --resume to continue, or use a new --workdir")
    return steps[-1] if resume and steps[-1] >= total_steps else None


def _save_tokenizer(tok, workdir: pathlib.Path) -> None:
    """A sentencepiece run keeps its model beside the checkpoints (sampling and export read it)."""
    path = getattr(tok, "path", None)
    if path is not None and pathlib.Path(path).suffix == ".model":
        shutil.copyfile(path, workdir / "tokenizer.model")


def train(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    workdir = pathlib.Path(workdir)
    t, m, e = config.train, config.model, config.eval
    finished = _check_resume(workdir / "checkpoints", resume, t.steps)
    if finished is not None:
        return {"step": finished, "nothing_to_do": True, "stopped_by": None, "eval_loss": None}
    # Everything that can fail without data is checked before curation and tokenization.
    check_data_config(config)
    run = build_run(config)
    signature = run.signature()
    run.check_batch(t.batch_size, t.micro_batches)
    run.check_batch(e.batch_size, 1, key="eval.batch_size")
    workdir.mkdir(parents=True, exist_ok=True)
    data = _load_data(config, show_progress)
    is_main = jax.process_index() == 0
    if is_main:
        (workdir / "config.json").write_text(config.to_json(indent=2))
        (workdir / "data_stats.json").write_text(json.dumps(data.stats, indent=2))
        _save_tokenizer(data.tokenizer, workdir)
    print(describe(data.stats))

    placer = run.placer(signature)
    seq = config.data.seq_len
    data_iter = iter(train_dataset(data.train, seq_len=seq, global_batch=t.batch_size, seed=t.seed,
                                   rows=placer.rows))
    checkpointer = Checkpointer.from_config(workdir / "checkpoints", config)
    target = run.abstract_state()
    health = None
    if resume:
        state, step, meta = checkpointer.restore(target, data_iter)
        health = meta.get("health")
        if is_main:
            truncate_after(workdir / "metrics.jsonl", step)
        print(f"resumed from step {step}")
    else:
        state = run.init_state()
        if is_main and (workdir / "metrics.jsonl").exists():  # a run that died before its first checkpoint
            (workdir / "metrics.jsonl").replace(workdir / "metrics.jsonl.prev")

    step_fn = run.train_step(signature)
    eval_signature = run.signature(e.batch_size)
    batches = eval_batches(data.heldout, seq_len=seq, batch_size=e.batch_size, n_batches=e.batches)
    evaluate = _evaluator(run.eval_step(eval_signature), batches, run.placer(eval_signature))

    flops = plan.flops_per_token(m, seq)
    peak, peak_source = _peak(config)
    writer = MetricsWriter(workdir, enabled=is_main)
    if not resume:
        writer.write(0, {"unigram_baseline": data.stats["unigram_entropy_nats"], "params": plan.param_count(m),
                         "flops_per_token": flops, "peak_flops": peak, "train_docs": data.stats["train_docs"],
                         "split_docs": data.stats["split_docs"]} | evaluate(state))
    spec_loop = LoopSpec(t.steps, t.log_every, e.every_steps, t.batch_size * seq, flops, peak,
                         config.checkpoint.agree_every_steps)
    with StopSignal() as stop:
        faults = Faults(FaultPolicy.from_config(t), stop, target, health)
        state, last = run_loop(spec_loop, state, step_fn, data_iter, placer, evaluate=evaluate, writer=writer,
                               checkpointer=checkpointer, faults=faults, show_progress=show_progress and is_main)
        checkpointer.close()  # a signal during the last save still lets it finish
    writer.close()
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"], "eval_loss": None}
    last |= {"peak_flops": peak, "peak_flops_source": peak_source}
    return _finish(config, workdir, run, state, data, last, is_main)


def _peak(config) -> tuple[float, str]:
    """The peak FLOP/s that MFU divides by, and where it came from."""
    if config.train.peak_flops > 0:
        return config.train.peak_flops, "train.peak_flops (given)"
    n = len(jax.devices())
    per_device = measure_matmul_peak(config.model.compute_dtype)
    return per_device * n, (f"measured at start-up: a 2048^3 {config.model.compute_dtype} matmul on one device "
                            f"({per_device / 1e9:.0f} GFLOP/s) x {n} device(s); set train.peak_flops to the "
                            "vendor's figure for a stable MFU")


SUMMARY_KEYS = ("loss", "eval_loss", "tokens_per_s", "mfu", "run_tokens_per_s", "run_mfu", "run_train_seconds",
                "peak_flops", "peak_flops_source", "compile_s")


def _sample(config, run, params, tok) -> str:
    """What the trained model writes after `train.sample_prompt` (the KV-cache sampler, on the run's mesh)."""
    prompt, t = config.train.sample_prompt, config.train
    room = run.spec.max_seq_len - len(tok.encode(prompt))
    sampling = SamplingParams(max_new_tokens=max(1, min(t.sample_tokens, room)), temperature=0.8, seed=t.seed)
    generator = Generator(run.model, params, sampling, eos_id=tok.eos_id, mesh=run.mesh, rules=run.rules)
    return prompt + complete(generator, tok, [prompt])[0]["text"]


def _finish(config, workdir, run, state, data, last: dict, is_main: bool) -> dict:
    """Plot, sample and a summary; only process 0 writes files."""
    text = _sample(config, run, state.params, data.tokenizer)
    summary = {"step": int(jax.device_get(state.step)), "unigram_baseline": data.stats["unigram_entropy_nats"]}
    summary |= {k: last.get(k) for k in SUMMARY_KEYS}
    if is_main:
        plot_curves(workdir / "metrics.jsonl", workdir / "loss.png", baseline=summary["unigram_baseline"])
        (workdir / "sample.txt").write_text(text)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print("--- sample ---\n" + text + "\n--------------")
    return summary | {"sample": text}
