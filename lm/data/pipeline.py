"""From a flat token array to batches (the batch contract of DESIGN.md section 4).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens
(window i starts at i * seq_len; its last token is only a target). Documents are
separated by EOS, so a window can hold the end of one document and the start of
the next: `segment_ids` and `positions` say where each document starts, so
attention and RoPE never cross a document boundary.

Training order is a grain index permutation, so the iterator state is a few
integers and resuming from a checkpoint reproduces the exact batches.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from lm.errors import UserError

# The batch contract: every text batch has these [B, T] fields.
BATCH_DTYPES = {
    "inputs": np.int32,
    "targets": np.int32,
    "loss_mask": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}


def window_example(tokens, start: int, seq_len: int, eos_id: int) -> dict:
    """One row of the batch contract from tokens[start : start + seq_len + 1]."""
    chunk = np.asarray(tokens[start : start + seq_len + 1], dtype=np.int32)
    if len(chunk) != seq_len + 1:
        raise ValueError(f"window at {start} needs {seq_len + 1} tokens, got {len(chunk)}")
    inputs, targets = chunk[:-1], chunk[1:]
    is_eos = inputs == eos_id
    # The EOS belongs to the document it ends; the next document starts after it.
    eos_before = np.cumsum(is_eos) - is_eos
    idx = np.arange(seq_len)
    starts_doc = np.concatenate([[True], is_eos[:-1]])
    doc_start = np.maximum.accumulate(np.where(starts_doc, idx, 0))
    return {
        "inputs": inputs,
        "targets": targets,
        # Predicting the next document's first token from the previous one is noise.
        "loss_mask": (~is_eos).astype(np.float32),
        "segment_ids": (1 + eos_before).astype(np.int32),
        "positions": (idx - doc_start).astype(np.int32),
    }


def n_windows(tokens, seq_len: int) -> int:
    return max(len(tokens) - 1, 0) // seq_len


def _window(i, *, tokens, seq_len, eos_id):
    return window_example(tokens, int(i) * seq_len, seq_len, eos_id)


def train_dataset(
    tokens,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    eos_id: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """An endless, per-epoch reshuffled, host-sharded stream of [batch_size, seq_len] batches.

    batch_size is per process. Every process builds the same permutation (same seed)
    and takes every process_count-th window of it, so the hosts' shares are disjoint
    within each epoch and together cover it.
    """
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"data: seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
    if not 0 <= process_index < process_count:
        raise UserError(f"data: process_index {process_index} not in [0, {process_count})")
    n = n_windows(tokens, seq_len)
    # Drop the last n % process_count windows so every host's share has the same size
    # and grain's repeat keeps epochs aligned across hosts (at most process_count-1 lost).
    n -= n % process_count
    per_process = n // process_count
    if per_process < batch_size:
        raise UserError(
            f"data: the training tokens ({len(tokens)}) give {per_process} windows of "
            f"{seq_len + 1} tokens per process, fewer than one batch of {batch_size}; "
            "use a larger corpus (or max_bytes), or a smaller seq_len or batch_size"
        )
    fn = functools.partial(_window, tokens=tokens, seq_len=seq_len, eos_id=eos_id)
    ds = (
        grain.MapDataset.range(n)
        .shuffle(seed=seed)
        [process_index::process_count]
        .repeat()  # infinite; reseeds the shuffle for each epoch
        .map(fn)
        .batch(batch_size, drop_remainder=True)
    )
    return ds.to_iter_dataset()


def eval_batches(
    tokens, *, seq_len: int, batch_size: int, n_batches: int, eos_id: int
) -> list[dict]:
    """The first n_batches * batch_size windows, in order: the same every time.

    If the text holds fewer windows, the last batch is filled with padding rows
    (segment_ids 0, loss_mask 0) so every batch has the same shape (no recompiles).
    """
    n = min(n_windows(tokens, seq_len), n_batches * batch_size)
    if n == 0:
        raise UserError(
            f"data: the held-out text has {len(tokens)} tokens but one eval window needs "
            f"{seq_len + 1}; use a larger heldout_fraction or corpus, or a smaller seq_len"
        )
    rows = [window_example(tokens, i * seq_len, seq_len, eos_id) for i in range(n)]
    pad = {k: np.zeros_like(v) for k, v in rows[0].items()}
    rows += [pad] * (-n % batch_size)
    return [
        {k: np.stack([r[k] for r in rows[b : b + batch_size]]) for k in pad}
        for b in range(0, len(rows), batch_size)
    ]
