"""`lm train`: checks -> run set-up -> data -> sharded state -> loop -> checkpoints, metrics, plot, sample.

Everything the run writes lives under `workdir`; prepared data (curated text, tokenizer, token
shards) lives in the shared data cache and is reused by every run with the same inputs.
"""

from __future__ import annotations

import json
import pathlib

import jax

from lm import plan
from lm.data.cache import data_cache_dir
from lm.data.checks import check_data_config
from lm.data.pipeline import eval_batches, train_dataset
from lm.data.prepare import describe, prepare_pretrain_data
from lm.eval.during import with_sets
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete
from lm.store.meta import save_tokenizer
from lm.train.fit import check_resume, evaluator, fit
from lm.train.metrics import plot_curves
from lm.train.setup import build_run


def _load_data(config, progress: bool):
    d = config.data
    return prepare_pretrain_data(d, data_cache_dir(d), vocab_size=config.model.vocab_size, progress=progress,
                                 curate_cfg=config.curate)


def train(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    workdir = pathlib.Path(workdir)
    t, m, e = config.train, config.model, config.eval
    finished = check_resume(workdir / "checkpoints", resume, t.steps)
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
        save_tokenizer(data.tokenizer, workdir)
    print(describe(data.stats))

    placer = run.placer(signature)
    seq = config.data.seq_len
    data_iter = iter(train_dataset(data.train, seq_len=seq, global_batch=t.batch_size, seed=t.seed,
                                   rows=placer.rows))
    eval_signature = run.signature(e.batch_size)
    batches = eval_batches(data.heldout, seq_len=seq, batch_size=e.batch_size, n_batches=e.batches)
    evaluate = evaluator(run.eval_step(eval_signature), batches, run.placer(eval_signature))
    first_row = {"unigram_baseline": data.stats["unigram_entropy_nats"], "params": plan.param_count(m),
                 "train_docs": data.stats["train_docs"], "split_docs": data.stats["split_docs"]}
    evaluate = with_sets(evaluate, e, run.built, data.tokenizer)
    state, last = fit(run, workdir, data_iter, resume=resume, init=run.init_state, evaluate=evaluate,
                      first_row=first_row, signature=signature, show_progress=show_progress)
    if last["stopped_by"]:
        return {"step": last["stop_step"], "stopped_by": last["stopped_by"], "eval_loss": None}
    return _finish(config, workdir, run, state, data, last, is_main)


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
