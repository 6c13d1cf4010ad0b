"""`lm sft`: supervised fine-tuning of a trained model on conversations, fully or with LoRA, as a
stage (lm.train.stage).

The run starts from the params of `finetune.init` (an `lm train`/`lm sft` workdir or an `lm export`),
keeps its model config and tokenizer, and trains on the assistant tokens of `finetune.data`. With
model.lora_rank > 0 only the adapters train: the base is frozen (no gradients, no optimizer
state, not in checkpoints). At the end the held-out conversations (`finetune.eval_data`) are answered
greedily with the chat template by the initial and the tuned model, and their exact-match
accuracies are reported.
"""

from __future__ import annotations

import math

from lm.data.cache import data_cache_dir
from lm.data.pipeline import Source, eval_batches, train_dataset
from lm.data.sft import SftSettings, describe, prepare_sft
from lm.eval.answers import answer_accuracy, read_conversations
from lm.model import counts
from lm.model.lora import is_adapter
from lm.train.fit import evaluator
from lm.train.losses import sft_loss
from lm.train.setup import build_run
from lm.train.stage import Stage, first_eval, require_data, run_stage, trainable_count, with_steps

PACK_FILL = 0.9  # share of a packed row's positions that hold tokens, for steps from epochs
SUMMARY_KEYS = ("loss", "eval_loss", "tokens_per_s", "run_tokens_per_s", "run_mfu", "peak_flops_source", "compile_s")


def settings(config) -> SftSettings:
    s = config.finetune
    return SftSettings(
        seq_len=config.data.seq_len,
        truncation=s.truncation,
        train_on=s.train_on,
        on_bad_record=s.on_bad_record,
        max_skipped_fraction=s.max_skipped_fraction,
    )


def steps_for_epochs(stats: dict, epochs: float, batch_size: int, seq_len: int) -> int:
    """Steps that show the data about `epochs` times: predictions / (rows per step * filled positions)."""
    return max(1, math.ceil(epochs * stats["total_tokens"] / (batch_size * seq_len * PACK_FILL)))


class Sft(Stage):
    """Conversations in, the masked next-token loss on the assistant tokens, exact match out."""

    init_section = "finetune"
    name = "sft"
    eval_metrics = ("loss",)
    response_loss = "eval_loss"  # the held-out metric the table shows as the response loss

    def check(self, config) -> None:
        require_data(config.finetune.data, "finetune.data", "give --data train.jsonl (chat or instruction JSONL)")

    def read(self, ctx):
        s, tok = ctx.config.finetune, ctx.init.tokenizer
        cache = data_cache_dir(ctx.config.data)
        train = prepare_sft(s.data, tok, settings(ctx.config), cache)
        print(f"{self.verb} data {s.data}: {describe(train.stats)}")
        heldout = prepare_sft(s.eval_data, tok, settings(ctx.config), cache) if s.eval_data else None
        return train, heldout

    def configure(self, ctx):
        c = ctx.config
        if c.finetune.epochs <= 0:
            return c
        return with_steps(c, steps_for_epochs(ctx.data[0].stats, c.finetune.epochs, c.train.batch_size, c.data.seq_len))

    def loss(self, config):
        return sft_loss

    def build(self, ctx):
        lora = ctx.config.model.lora_rank > 0
        return build_run(
            ctx.config, self.loss(ctx.config), trainable=is_adapter if lora else None, frozen=self.frozen_slots(ctx)
        )

    def frozen_slots(self, ctx) -> dict | None:
        return None

    def stats(self, ctx) -> dict:
        train, heldout = ctx.data
        return {"train": train.stats} | ({"heldout": heldout.stats} if heldout else {})

    def batches(self, ctx):
        run, t, s = ctx.run, ctx.config.train, ctx.config.finetune
        signature = run.signature()
        data_iter = iter(
            train_dataset(
                [Source(s.data, ctx.data[0], 1.0)],
                seq_len=ctx.config.data.seq_len,
                global_batch=t.batch_size,
                seed=t.seed,
                rows=run.placer(signature).rows,
            )
        )
        return data_iter, signature, None

    def evaluator(self, ctx):
        run, e, heldout = ctx.run, ctx.config.eval, ctx.data[1]
        if heldout is None:
            return None
        signature = run.signature(e.batch_size)
        batches = eval_batches(
            [Source(ctx.config.finetune.eval_data, heldout, 1.0)],
            seq_len=ctx.config.data.seq_len,
            batch_size=e.batch_size,
            n_batches=e.batches,
        )
        return evaluator(
            run.eval_step(signature), batches, run.placer(signature), ctx.frozen, metrics=self.eval_metrics
        )

    def first_row(self, ctx) -> dict:
        return {
            "params": counts.param_count(ctx.config.model),
            "trainable_params": trainable_count(ctx.run),
            **{f"data/{k}": v for k, v in ctx.data[0].stats.items()},
        }

    def finish(self, ctx) -> dict:
        c, init = ctx.config, ctx.init
        summary = {
            "step": c.train.steps,
            "init": c.finetune.init,
            "lora_rank": c.model.lora_rank,
            "data": ctx.data[0].stats,
        } | {k: ctx.last.get(k) for k in SUMMARY_KEYS}
        if c.finetune.eval_data:
            conversations = read_conversations(c.finetune.eval_data, c.finetune.eval_examples)
            n_new = c.finetune.eval_max_new_tokens
            before = answer_accuracy(init.config, init.params, init.tokenizer, conversations, n_new)
            after = answer_accuracy(c, ctx.params, init.tokenizer, conversations, n_new)
            summary |= {
                "exact_match_init": before["exact_match"],
                "exact_match": after["exact_match"],
                "exact_match_n": after["n"],
                "answers": after["examples"],
            }
            summary["eval_loss_init"] = first_eval(ctx.workdir).get("eval_loss")
            key = self.response_loss
            print(
                table(
                    [
                        ("init", first_eval(ctx.workdir).get(key), before["exact_match"]),
                        (self.verb, ctx.last.get(key), after["exact_match"]),
                    ],
                    after["n"],
                )
            )
        return summary


def table(rows, n: int) -> str:
    """model | held-out response loss | exact match, as aligned text."""
    lines = [f"{'model':<12} {'response loss':>14} {'exact match':>12}   ({n} held-out prompts, greedy)"]
    for name, loss, acc in rows:
        loss_text = f"{loss:.4f}" if isinstance(loss, float) else "-"
        lines.append(f"{name:<12} {loss_text:>14} {acc:>11.1%}")
    return "\n".join(lines)


def sft(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Sft(), config, workdir, resume, show_progress)


def compiled_step(config, devices, spec):
    """The step `lm plan` compiles (lm.train.registry): the SFT loss, over LoRA adapters alone when
    model.lora_rank > 0 (the base frozen)."""
    run = build_run(
        config, sft_loss, devices=devices, spec=spec, trainable=is_adapter if config.model.lora_rank > 0 else None
    )
    return run, run.signature()
