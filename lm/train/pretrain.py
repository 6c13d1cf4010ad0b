"""`lm train`: data -> model -> sharded state -> loop -> checkpoints, metrics, plot, sample.

Everything the run writes lives under `workdir`.
"""

from __future__ import annotations

import json
import pathlib

import jax

from lm import plan
from lm.config import rules_table
from lm.data.pipeline import eval_batches, train_dataset
from lm.data.prepare import describe, prepare_pretrain_data
from lm.errors import UserError
from lm.infer.sample import generate
from lm.model.layers import ModelSpec, Partitioning
from lm.model.transformer import Transformer
from lm.perf import measure_matmul_peak
from lm.sharding import batch_sharding, host_batch_to_global, make_mesh, split_count
from lm.train.checkpoint import Checkpointer, saved_steps
from lm.train.faults import FaultPolicy, StopSignal
from lm.train.loop import Faults, LoopSpec, run_loop
from lm.train.losses import pretrain_loss
from lm.train.metrics import MetricsWriter, plot_curves, truncate_after
from lm.train.optim import make_optimizer
from lm.train.state import abstract_state, create_state
from lm.train.steps import make_eval_step, make_train_step


def _load_data(config, workdir: pathlib.Path, progress: bool):
    d = config.data
    cache = pathlib.Path(d.cache_dir) if d.cache_dir else workdir / "data"
    return prepare_pretrain_data(d, cache, vocab_size=config.model.vocab_size, progress=progress,
                                 curate_cfg=config.curate)


def _evaluator(eval_fn, batches, to_device):
    """Held-out loss over fixed batches; each process feeds a disjoint share of every batch's rows."""
    pi, n_proc = jax.process_index(), jax.process_count()
    local = [{k: v[pi::n_proc] for k, v in batch.items()} for batch in batches]

    def evaluate(state):
        total, count = 0.0, 0.0
        for batch in local:
            stats = jax.device_get(eval_fn(state.params, to_device(batch)))
            total, count = total + float(stats["loss_sum"]), count + float(stats["count"])
        return {"eval_loss": total / max(count, 1.0), "eval_tokens": count}

    return evaluate


def _check_batch_split(batch_size: int, micro_batches: int, n_proc: int, sharding,
                       key: str = "train.batch_size") -> None:
    """Every micro-batch must split evenly over the batch-sharded devices and the processes."""
    n_shards = split_count(sharding.mesh, sharding.spec[0] if sharding.spec else None)
    if batch_size % n_proc or (batch_size // micro_batches) % n_shards:
        raise UserError(f"{key}={batch_size} with {micro_batches} micro-batch(es) gives "
                        f"micro-batches of {batch_size // micro_batches} rows, which must divide evenly over "
                        f"the {n_shards} batch shards of the mesh and {n_proc} processes")


def _check_resume(directory: pathlib.Path, resume: bool) -> None:
    """--resume needs a checkpoint and a fresh run must not find one: checked before any data work."""
    steps = saved_steps(directory)
    if resume and not steps:
        raise UserError(f"--resume: no checkpoint in '{directory}'; run without --resume to start fresh")
    if not resume and steps:
        raise UserError(f"'{directory.parent}' already holds checkpoints (steps {steps[0]}..{steps[-1]}); "
                        "pass --resume to continue, or use a new --workdir")


def train(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    workdir = pathlib.Path(workdir)
    _check_resume(workdir / "checkpoints", resume)
    workdir.mkdir(parents=True, exist_ok=True)
    # Data first, before JAX starts its runtime threads: curation and tokenization start worker
    # processes, and forking a process that runs XLA threads can deadlock.
    data = _load_data(config, workdir, show_progress)
    is_main = jax.process_index() == 0
    if is_main:
        (workdir / "config.json").write_text(config.to_json(indent=2))
        (workdir / "data_stats.json").write_text(json.dumps(data.stats, indent=2))
    t, m = config.train, config.model
    print(describe(data.stats))

    rules = rules_table(config)
    mesh = make_mesh(config.mesh)
    spec = ModelSpec.from_config(m)
    model = Transformer(spec, Partitioning(mesh, rules))
    optimizer, schedule = make_optimizer(config.optim, t.steps)
    state, shardings = create_state(model, optimizer, mesh, rules, t.seed)
    b_sharding = batch_sharding(mesh, rules)
    to_device = lambda batch: host_batch_to_global(batch, b_sharding)  # noqa: E731

    n_proc, seq = jax.process_count(), config.data.seq_len
    _check_batch_split(t.batch_size, t.micro_batches, n_proc, b_sharding)
    data_iter = iter(train_dataset(data.train, seq_len=seq, global_batch=t.batch_size, seed=t.seed,
                                   process_index=jax.process_index(), process_count=n_proc))
    checkpointer = Checkpointer.from_config(workdir / "checkpoints", config)
    target = abstract_state(model, optimizer, shardings)
    health = None
    if resume:
        state, step, meta = checkpointer.restore(target, data_iter)
        health = meta.get("health")
        if is_main:
            truncate_after(workdir / "metrics.jsonl", step)
        print(f"resumed from step {step}")
    elif is_main and (workdir / "metrics.jsonl").exists():  # a run that died before its first checkpoint
        (workdir / "metrics.jsonl").replace(workdir / "metrics.jsonl.prev")

    loss_fn = pretrain_loss(model, config.optim.z_loss)
    step_fn = make_train_step(loss_fn, optimizer, schedule, mesh, shardings, b_sharding, t.micro_batches)
    e = config.eval
    _check_batch_split(e.batch_size, 1, n_proc, b_sharding, key="eval.batch_size")
    batches = eval_batches(data.heldout, seq_len=seq, batch_size=e.batch_size, n_batches=e.batches)
    evaluate = _evaluator(make_eval_step(loss_fn, mesh, shardings.params, b_sharding), batches, to_device)

    flops = plan.flops_per_token(m, seq)
    peak = t.peak_flops or measure_matmul_peak(m.compute_dtype) * len(jax.devices())
    writer = MetricsWriter(workdir, enabled=is_main)
    if not resume:
        writer.write(0, {"unigram_baseline": data.stats["unigram_entropy_nats"], "params": plan.param_count(m),
                         "flops_per_token": flops, "peak_flops": peak, "train_docs": data.stats["train_docs"],
                         "split_docs": data.stats["split_docs"]} | evaluate(state))
    spec_loop = LoopSpec(t.steps, t.log_every, e.every_steps, t.batch_size * seq, flops, peak,
                         config.checkpoint.agree_every_steps)
    with StopSignal() as stop:
        faults = Faults(FaultPolicy.from_config(t), stop, target, health)
        state, last = run_loop(spec_loop, state, step_fn, data_iter, to_device, evaluate=evaluate, writer=writer,
                               checkpointer=checkpointer, faults=faults, show_progress=show_progress and is_main)
        checkpointer.close()  # a signal during the last save still lets it finish
    writer.close()
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"], "eval_loss": None}
    return _finish(config, workdir, model, state, data, last, is_main)


def _finish(config, workdir, model, state, data, last: dict, is_main: bool) -> dict:
    """Plot, sample and a summary; only process 0 writes files."""
    tok = data.tokenizer
    prompt = tok.encode(config.train.sample_prompt)
    sample_model = Transformer(model.spec)  # unconstrained: batch of one
    ids = generate(sample_model, state.params, prompt, config.train.sample_tokens, config.data.seq_len,
                   seed=config.train.seed)
    text = tok.decode(ids)
    summary = {"step": int(jax.device_get(state.step)), "unigram_baseline": data.stats["unigram_entropy_nats"]}
    summary |= {k: last.get(k) for k in ("loss", "eval_loss", "tokens_per_s", "mfu", "compile_s")}
    if is_main:
        plot_curves(workdir / "metrics.jsonl", workdir / "loss.png", baseline=summary["unigram_baseline"])
        (workdir / "sample.txt").write_text(text)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print("--- sample ---\n" + text + "\n--------------")
    return summary | {"sample": text}

