"""What `lm dpo` and `lm reward` share, as a stage (lm.train.stage): preference pairs in, a run
over [B, 2, T] batches (lm.train.pair_losses), and the held-out pair metrics before and after."""

from __future__ import annotations

import math

import numpy as np

from lm.data.cache import data_cache_dir
from lm.data.pipeline import Source, ready_batches, train_dataset
from lm.data.preference import describe, prepare_pairs
from lm.data.sft import SftSettings
from lm.train.fit import evaluator
from lm.train.metrics import plot_curves
from lm.train.stage import Stage, require_data, trainable_count, with_steps

# Every pair row carries its margin (the reward model's; DPO ignores it).
PAIR_EXTRA = {"margin": ((), np.float32)}


class WithFields:
    """Ready rows with per-row fields added: i -> rows[i] | {name: values[i]} (e.g. reference log-probs)."""

    def __init__(self, rows, fields: dict[str, np.ndarray]):
        self.rows, self.fields = rows, fields
        self.seq_len = rows.seq_len
        for name, values in fields.items():
            if len(values) != len(rows):
                raise ValueError(f"field '{name}' has {len(values)} rows for {len(rows)} pairs")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i] | {k: v[i] for k, v in self.fields.items()}


def settings(config) -> SftSettings:
    p = config.finetune
    return SftSettings(
        seq_len=config.data.seq_len,
        truncation=p.truncation,
        on_bad_record=p.on_bad_record,
        max_skipped_fraction=p.max_skipped_fraction,
    )


def steps_for_epochs(pairs: int, epochs: float, batch_size: int) -> int:
    return max(1, math.ceil(epochs * pairs / batch_size))


class PairStage(Stage):
    """Pairs in; a stage adds its run, its per-pair fields and its report."""

    init_section = "finetune"
    eval_metrics: tuple = ("loss",)
    row_fields: dict = PAIR_EXTRA  # the per-pair fields every row carries

    def check(self, config) -> None:
        require_data(
            config.finetune.data,
            "finetune.data",
            f'give `lm {self.verb} --data pairs.jsonl` ({{"prompt", "chosen", "rejected"}} lines)',
        )

    def read(self, ctx):
        p, tok = ctx.config.finetune, ctx.init.tokenizer
        cache = data_cache_dir(ctx.config.data)
        train = prepare_pairs(p.data, tok, settings(ctx.config), cache)
        print(f"{self.verb} data {p.data}: {describe(train.stats)}")
        heldout = prepare_pairs(p.eval_data, tok, settings(ctx.config), cache) if p.eval_data else None
        return train, heldout

    def configure(self, ctx):
        c = ctx.config
        if c.finetune.epochs <= 0:
            return c
        return with_steps(c, steps_for_epochs(len(ctx.data[0]), c.finetune.epochs, c.train.batch_size))

    def stats(self, ctx) -> dict:
        train, heldout = ctx.data
        return {"train": train.stats} | ({"heldout": heldout.stats} if heldout else {})

    def fields(self, ctx) -> tuple[dict, dict | None, dict | None]:
        """({name: (per-pair shape, dtype)} beyond the margin, their train values, held-out values)."""
        return {}, None, None

    def batches(self, ctx):
        run, t, c = ctx.run, ctx.config.train, ctx.config
        extra, train_fields, self._held_fields = self.fields(ctx)
        self._extra = self.row_fields | extra
        signature = run.signature(pairs=True, extra=self._extra)
        rows = WithFields(ctx.data[0], train_fields) if train_fields else ctx.data[0]
        data_iter = iter(
            train_dataset(
                [Source(c.finetune.data, rows, 1.0)],
                seq_len=c.data.seq_len,
                global_batch=t.batch_size,
                seed=t.seed,
                rows=run.placer(signature).rows,
                pack=False,
            )
        )
        return data_iter, signature, None

    def evaluator(self, ctx):
        run, e, heldout = ctx.run, ctx.config.eval, ctx.data[1]
        if heldout is None:
            return None
        held = WithFields(heldout, self._held_fields) if self._held_fields else heldout
        signature = run.signature(e.batch_size, pairs=True, extra=self._extra)
        batches = ready_batches(held, e.batch_size, ctx.config.pairs.eval_pairs)
        return evaluator(
            run.eval_step(signature), batches, run.placer(signature), ctx.frozen, metrics=self.eval_metrics
        )

    def first_row(self, ctx) -> dict:
        return {"trainable_params": trainable_count(ctx.run), **{f"data/{k}": v for k, v in ctx.data[0].stats.items()}}

    def plot(self, ctx) -> None:  # a pair's loss (-log sigmoid of a margin, or IPO's square) is not per token
        plot_curves(ctx.workdir / "metrics.jsonl", ctx.workdir / "loss.png", loss_label="loss (mean per pair)")

    def held_out_pairs(self, ctx) -> int | None:
        heldout = ctx.data[1]
        return min(ctx.config.pairs.eval_pairs, len(heldout)) if heldout is not None else None


def eval_table(title: str, keys: tuple, before: dict, after: dict, n: int | None, unit: str = "pairs") -> str:
    """Held-out metrics of the init and the tuned model, one line each."""
    head = f"{'model':<8}" + "".join(f" {k:>20}" for k in keys)
    lines = [f"{title} ({n} held-out {unit})" if n else title, head]
    for name, row in (("init", before), ("tuned", after)):
        cells = [row.get(f"eval_{k}") for k in keys]
        lines.append(f"{name:<8}" + "".join(f" {c:>20.4f}" if isinstance(c, float) else f" {'-':>20}" for c in cells))
    return "\n".join(lines)
