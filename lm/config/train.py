"""The `train` section: the loop's size and cadence, and what it does on numerical faults."""

from __future__ import annotations

from lm.config.core import require

# numerical faults: non-finite steps are skipped; after max_bad_steps in a row, or a loss
# spike (loss > median + spike_threshold * robust std over spike_window steps; 0 = off),
# on_bad restores the last good checkpoint and skips ahead in the data, or stops
DEFAULTS = dict(
    steps=500,
    batch_size=16,
    micro_batches=1,
    seed=0,
    log_every=10,
    peak_flops=0.0,
    sample_tokens=200,
    sample_prompt="def",  # no trailing space: BPE attaches it to the next word
    max_bad_steps=5,
    on_bad="restore",
    spike_window=0,
    spike_threshold=8.0,
    max_rollbacks=3,
    # the trained params' (and so their gradients' and Adam moments') dtype: float32 master weights,
    # or bfloat16 throughout (half the state's memory; rounding can swallow small updates)
    param_dtype="float32",
    init="",  # continued pretraining: a run, an export or a Hugging Face model to start from ("" = fresh)
)

CHOICES = dict(on_bad=("restore", "stop"), param_dtype=("float32", "bfloat16"))


def check(c) -> None:
    t = c.train
    require(t.steps > 0, "train.steps", t.steps, "expected a positive integer")
    require(t.sample_tokens >= 0, "train.sample_tokens", t.sample_tokens, "expected >= 0 (0 = no closing sample)")
    require(
        t.micro_batches > 0 and t.batch_size % t.micro_batches == 0,
        "train.micro_batches",
        t.micro_batches,
        f"must be positive and divide train.batch_size={t.batch_size}",
    )
    for key in ("max_bad_steps", "max_rollbacks"):
        require(t[key] >= 1, f"train.{key}", t[key], "expected a positive integer")
    require(
        t.spike_window == 0 or t.spike_window >= 8,
        "train.spike_window",
        t.spike_window,
        "expected 0 (off) or at least 8 steps",
    )
    require(t.spike_threshold > 0, "train.spike_threshold", t.spike_threshold, "expected > 0")
