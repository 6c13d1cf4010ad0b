"""Preference pairs: records -> tokenized, masked, padded, cached pairs (for `lm dpo`, `lm reward`).

The data is a records path (lm.data.records: JSONL, Parquet, Arrow, a datasets folder); each record
is one pair, with its prompt explicit or implicit (TRL's forms, lm.data.conversations):

  {"prompt": STR or MESSAGES, "chosen": STR or [ASSISTANT MESSAGE], "rejected": ..., "margin": NUMBER}
  {"chosen": MESSAGES, "rejected": MESSAGES, "margin": NUMBER}   (implicit prompt)

A string prompt is one user turn; a list is chat messages ending with a user turn. A string
response is one assistant turn; a one-element list holding an assistant message is TRL's
conversational form of the same. Without "prompt", chosen and rejected are whole conversations:
the prompt is the messages both start with, and each goes on with one assistant message.
margin (optional, default 0) is the reward model's.
Each side is rendered with the one chat template (`lm.data.chat`) as prompt + response with
`train_on="last"`: the loss mask is 1 on the response and its end marker only.

A side of n tokens holds n-1 predictions; a pair fits when both sides have at most seq_len.
Longer pairs are dropped or cut (`SftSettings.truncation`), and every outcome is counted. A pair
whose sides are identical (given so, or made so by a cut) or whose cut left a side no response
token is skipped and counted; too many of the latter is an error.

Cached (`lm.data.cache`) under a name fingerprinting the file, the tokenizer and the settings:
tokens int32 [N, 2, L+1] (0 = padding), weights uint8 [N, 2, L+1], lengths int32 [N, 2],
margins float32 [N], stats.json; row 0 of a pair is the chosen side, row 1 the rejected one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from lm.data import chat
from lm.data.cache import cached_dir
from lm.data.conversations import Identical, pair_messages, prompt_messages  # noqa: F401 (this reader's names)
from lm.data.records import ONE_OBJECT, iter_records, read_records, records_form
from lm.data.sft import SftSettings, cache_key, fit
from lm.data.tokens import write_json
from lm.errors import UserError

_VERSION = 1  # bump when the stored pairs change for the same inputs and settings
STAT_KEYS = (
    "pairs_read",
    "pairs_kept",
    "dropped_too_long",
    "truncated_prompt",
    "truncated_response",
    "skipped_identical",
    "skipped_empty_mask",
    "skipped_bad_records",
    "chosen_tokens",
    "rejected_tokens",
    "total_tokens",
)


class PairExamples:
    """Random access to cached pairs: i -> {inputs, targets, loss_mask, segment_ids, positions: [2, L]; margin: ()}."""

    def __init__(self, directory: Path, seq_len: int, built: bool = False):
        self.path, self.name, self.seq_len, self.built = Path(directory), Path(directory).name, seq_len, built
        self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
        self.weights = np.load(self.path / "weights.npy", mmap_mode="r")
        self.lengths = np.load(self.path / "lengths.npy")
        self.margins = np.load(self.path / "margins.npy")
        self.stats = json.loads((self.path / "stats.json").read_text())

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        tokens = np.array(self.tokens[i], np.int32)
        real = np.arange(self.seq_len)[None, :] < (self.lengths[i] - 1)[:, None]
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "loss_mask": np.array(self.weights[i, :, 1:], np.float32),
            "segment_ids": real.astype(np.int32),
            "positions": np.where(real, np.arange(self.seq_len, dtype=np.int32)[None, :], 0).astype(np.int32),
            "margin": np.float32(self.margins[i]),
        }

    def __repr__(self) -> str:
        return f"PairExamples('{self.path}', {len(self)} pairs)"


def parse_pair(record) -> tuple[list[dict], dict, dict, float]:
    """One record -> (prompt messages, chosen message, rejected message, margin)."""
    prompt, chosen, rejected = pair_messages(record)
    if chosen["content"] == rejected["content"]:
        raise Identical("'chosen' and 'rejected' are identical; a pair needs two different responses")
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"'margin' is {margin!r}; expected a finite number")
    return prompt, chosen, rejected, float(margin)


def read_pairs(path, limit: int = 0) -> list[tuple]:
    """The parsed pairs (parse_pair) of the first `limit` records (0 = all); a bad record is a
    UserError naming file and row."""
    pairs = read_records(path, parse_pair, what="preference pairs", expected=ONE_OBJECT, limit=limit)
    return [pair for _, pair in pairs]


def pair_conversations(path, limit: int = 0) -> list[list[dict]]:
    """prompt + chosen answer of the first `limit` pairs (0 = all): references for exact match."""
    return [prompt + [chosen] for prompt, chosen, _, _ in read_pairs(path, limit)]


def prepare_pairs(path, tokenizer, settings: SftSettings, cache_root) -> PairExamples:
    """The pairs of a records path, tokenized into the cache or reused from it."""
    settings.check()
    path = Path(path)
    records_form(path, "preference pairs")
    name = f"pairs-{tokenizer.name}-{cache_key(path, tokenizer, settings, _VERSION)}"
    out, built = cached_dir(Path(cache_root), name, lambda staging: _build(path, tokenizer, settings, staging))
    return PairExamples(out, settings.seq_len, built)


def _build(path: Path, tokenizer, settings: SftSettings, staging: Path) -> None:
    pairs, stats = tokenize_file(path, tokenizer, settings)  # checked before anything is written
    check_stats(path, stats, settings)
    staging.mkdir(parents=True, exist_ok=True)
    n, width = len(pairs), settings.seq_len + 1
    tokens, weights = np.zeros((n, 2, width), np.int32), np.zeros((n, 2, width), np.uint8)
    lengths, margins = np.zeros((n, 2), np.int32), np.zeros((n,), np.float32)
    for i, (sides, margin) in enumerate(pairs):
        for s, (ids, w) in enumerate(sides):
            tokens[i, s, : len(ids)], weights[i, s, : len(ids)], lengths[i, s] = ids, w, len(ids)
        margins[i] = margin
    for name, array in (("tokens", tokens), ("weights", weights), ("lengths", lengths), ("margins", margins)):
        np.save(staging / f"{name}.npy", array)
    write_json(staging / "stats.json", stats)


def tokenize_file(path: Path, tokenizer, settings: SftSettings) -> tuple[list, dict]:
    """([((chosen ids, weights), (rejected ids, weights)), margin] of the kept pairs, counts).

    pairs_read = pairs_kept + dropped_too_long + skipped_identical + skipped_empty_mask + skipped_bad_records.
    """
    template = chat.ChatTemplate.for_tokenizer(tokenizer)
    stats = dict.fromkeys(STAT_KEYS, 0)
    pairs = []

    def bad(error):  # a record that is not a pair: an error, or skipped and counted
        if settings.on_bad_record == "error":
            raise error
        stats["pairs_read"] += 1
        stats["skipped_identical" if isinstance(error.cause, Identical) else "skipped_bad_records"] += 1

    def render(record):
        prompt, chosen, rejected, margin = parse_pair(record)
        return [template.render(prompt + [m], "last") for m in (chosen, rejected)], margin

    for _, (sides, margin) in iter_records(path, render, expected=ONE_OBJECT, on_error=bad):
        stats["pairs_read"] += 1
        fitted = [fit(ids, w, settings) for ids, w in sides]
        if any(f is None for f in fitted):
            stats["dropped_too_long"] += 1
        elif any(not w[1:].any() for _, w in fitted):
            stats["skipped_empty_mask"] += 1
        elif np.array_equal(fitted[0][0], fitted[1][0]):
            stats["skipped_identical"] += 1
        else:
            stats["pairs_kept"] += 1
            if any(len(f[0]) < len(s[0]) for f, s in zip(fitted, sides)):
                stats["truncated_prompt" if settings.truncation == "cut_prompt_left" else "truncated_response"] += 1
            stats["chosen_tokens"] += int(fitted[0][1][1:].sum())
            stats["rejected_tokens"] += int(fitted[1][1][1:].sum())
            stats["total_tokens"] += sum(len(ids) - 1 for ids, _ in fitted)
            pairs.append((fitted, margin))
    return pairs, stats


def check_stats(path: Path, stats: dict, settings: SftSettings) -> None:
    """Fails on a file that yields no pair, or too many pairs left with no response token."""
    read, empty = stats["pairs_read"], stats["skipped_empty_mask"]
    if read and empty / read > settings.max_skipped_fraction:
        raise UserError(
            f"{path}: {empty} of {read} pairs ({empty / read:.1%}) have a side with no response token left after "
            f"truncation='{settings.truncation}' at seq_len={settings.seq_len} (limit finetune.max_skipped_fraction="
            f"{settings.max_skipped_fraction}); raise data.seq_len or change finetune.truncation"
        )
    if stats["pairs_kept"] == 0:
        raise UserError(
            f"{path}: no usable pair ({describe(stats)}); expected records with 'prompt', "
            "'chosen' and 'rejected' (or 'chosen' and 'rejected' conversations sharing a prompt) that fit data.seq_len"
        )


def describe(stats: dict) -> str:
    """One line for logs: what was kept and why the rest was not."""
    return ", ".join(f"{k} {stats[k]:,}" for k in STAT_KEYS)
