"""`lm train`: pretraining from scratch on prepared token shards, as a stage (lm.train.stage).

Prepared data (curated text, tokenizer, token shards) lives in the shared data cache and is
reused by every run with the same inputs; everything the run writes lives under its workdir.
At the end the model writes a sample after `train.sample_prompt` (sample.txt; none with
`train.sample_tokens=0`).
"""

from __future__ import annotations

import jax

from lm.data.cache import data_cache_dir
from lm.data.checks import check_data_config
from lm.data.pipeline import eval_batches, train_dataset
from lm.data.prepare import describe, prepare_pretrain_data
from lm.infer.generate import Generator, generation_context
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete
from lm.model import counts
from lm.train.fit import evaluator
from lm.train.metrics import plot_curves
from lm.train.setup import build_run
from lm.train.stage import Stage, run_stage

SUMMARY_KEYS = (
    "loss",
    "eval_loss",
    "tokens_per_s",
    "mfu",
    "run_tokens_per_s",
    "run_mfu",
    "run_train_seconds",
    "peak_flops",
    "peak_flops_source",
    "compile_s",
)


class Pretrain(Stage):
    name = "pretrain"
    init_section = "train"  # train.init: continued pretraining from a trained or imported model
    init_optional = True

    def check(self, config) -> None:
        # everything that can fail without data, before curation and tokenization
        check_data_config(config)
        run, t, e = build_run(config), config.train, config.eval
        run.check_batch(t.batch_size, t.micro_batches)
        run.check_batch(e.batch_size, 1, key="eval.batch_size")

    def read(self, ctx):
        d = ctx.config.data
        data = prepare_pretrain_data(
            d,
            data_cache_dir(d),
            vocab_size=ctx.config.model.vocab_size,
            progress=ctx.show_progress,
            curate_cfg=ctx.config.curate,
        )
        print(describe(data.stats))
        return data

    def build(self, ctx):
        return build_run(ctx.config)

    def stats(self, ctx) -> dict:
        return ctx.data.stats

    def tokenizer(self, ctx):
        return ctx.data.tokenizer

    def batches(self, ctx):
        run, t = ctx.run, ctx.config.train
        signature = run.signature()
        data_iter = iter(
            train_dataset(
                ctx.data.train,
                seq_len=ctx.config.data.seq_len,
                global_batch=t.batch_size,
                seed=t.seed,
                rows=run.placer(signature).rows,
            )
        )
        return data_iter, signature, None

    def evaluator(self, ctx):
        run, e = ctx.run, ctx.config.eval
        signature = run.signature(e.batch_size)
        batches = eval_batches(
            ctx.data.heldout, seq_len=ctx.config.data.seq_len, batch_size=e.batch_size, n_batches=e.batches
        )
        return evaluator(run.eval_step(signature), batches, run.placer(signature))

    def first_row(self, ctx) -> dict:
        s = ctx.data.stats
        return {
            "unigram_baseline": s["unigram_entropy_nats"],
            "params": counts.param_count(ctx.config.model),
            "train_docs": s["train_docs"],
            "split_docs": s["split_docs"],
        }

    def finish(self, ctx) -> dict:
        text = _sample(ctx.config, ctx.run, ctx.params, ctx.data.tokenizer) if ctx.config.train.sample_tokens else None
        summary = {
            "step": int(jax.device_get(ctx.state.step)),
            "unigram_baseline": ctx.data.stats["unigram_entropy_nats"],
        }
        summary |= {k: ctx.last.get(k) for k in SUMMARY_KEYS}
        ctx.returned["sample"] = text
        if ctx.is_main and text is not None:
            (ctx.workdir / "sample.txt").write_text(text)
            print("--- sample ---\n" + text + "\n--------------")
        return summary

    def plot(self, ctx) -> None:
        plot_curves(
            ctx.workdir / "metrics.jsonl", ctx.workdir / "loss.png", baseline=ctx.data.stats["unigram_entropy_nats"]
        )


def _sample(config, run, params, tok) -> str:
    """What the trained model writes after `train.sample_prompt` (the KV-cache sampler, on the run's mesh)."""
    prompt, t = config.train.sample_prompt, config.train
    room = generation_context(run.spec) - len(tok.encode(prompt))
    sampling = SamplingParams(max_new_tokens=max(1, min(t.sample_tokens, room)), temperature=0.8, seed=t.seed)
    generator = Generator(run.model, params, sampling, eos_id=tok.eos_id, mesh=run.mesh, rules=run.rules)
    return prompt + complete(generator, tok, [prompt])[0]["text"]


def train(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Pretrain(), config, workdir, resume, show_progress)


def compiled_step(config, devices, spec):
    """The step `lm plan` compiles (lm.train.registry): the whole model trained on next tokens."""
    run = build_run(config, devices=devices, spec=spec)
    return run, run.signature()
