"""Supervised fine-tuning examples: conversations -> tokenized, masked, cached examples.

The data is a records path (lm.data.records: JSONL, Parquet, Arrow, a datasets folder); each record
is one conversation, in any form of lm.data.conversations (detected per record):

  chat               {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
  prompt-completion  {"prompt": str | messages, "completion": str | messages} (TRL's two forms)
  instruction        {"instruction": str, "input": str (optional), "output": str, "system": str (optional)}

A prompt-completion record trains its completion only. An instruction becomes a user turn
(instruction, then "\n\n" + input when input is non-empty) and an assistant turn (output).
Conversations are rendered with the one chat template (`lm.data.chat`): the loss covers the
assistant turns only. A template that renders an earlier assistant turn otherwise once the
conversation goes on (Qwen3's drops its reasoning) trains that turn from its own prefix, as an
example of its own (lm.data.hf_chat): every assistant turn is trained as the model writes it.

An example of n tokens holds n-1 predictions; it fits a row when n-1 <= seq_len.
Longer ones are dropped or cut (`SftSettings.truncation`), and every outcome is
counted. An example left with no token to learn from is skipped, and too many of
those is an error: a run must never train on silently empty masks.

The result is cached (`lm.data.cache`) under a name fingerprinting the data's bytes,
the tokenizer and the settings, as memory-mapped .npy files:

  tokens.npy   int32, every example's ids back to back
  weights.npy  uint8, the loss weight of each token (0 or 1)
  offsets.npy  int64, start of each example, plus the total: n_examples + 1
  stats.json   the counts (see `tokenize_file`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from lm.config.sft import SftSettings
from lm.data import chat
from lm.data.cache import cached_dir
from lm.data.conversations import sft_example
from lm.data.conversations import sft_messages as parse_record  # noqa: F401 (the reader's name for it)
from lm.data.messages import Example
from lm.data.records import ONE_OBJECT, fingerprint, iter_records, records_form
from lm.data.tokens import write_json
from lm.errors import UserError

_VERSION = 2  # bump when the stored examples change for the same inputs and settings
_NOTHING = Example(np.zeros(0, np.int32), np.zeros(0, np.float32), 0)  # a record that trains no turn
STAT_KEYS = (
    "examples_read",
    "examples_kept",
    "dropped_too_long",
    "truncated_prompt",
    "truncated_response",
    "skipped_empty_mask",
    "skipped_bad_records",
    "turns_trained",
    "turns_own_prefix",
    "response_tokens",
    "total_tokens",
)


class SftExamples:
    """Random access to cached examples: i -> {'inputs', 'targets', 'loss_mask'} of length <= seq_len."""

    def __init__(self, directory: Path, seq_len: int, built: bool = False):
        self.path, self.name, self.seq_len, self.built = Path(directory), Path(directory).name, seq_len, built
        self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
        self.weights = np.load(self.path / "weights.npy", mmap_mode="r")
        self.offsets = np.load(self.path / "offsets.npy")
        self.stats = json.loads((self.path / "stats.json").read_text())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict:
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.array(self.tokens[start:stop], np.int32)
        return {
            "inputs": ids[:-1],
            "targets": ids[1:],
            "loss_mask": np.array(self.weights[start + 1 : stop], np.float32),
        }

    def __repr__(self) -> str:
        return f"SftExamples('{self.path}', {len(self)} examples)"


def prepare_sft(path, tokenizer, settings: SftSettings, cache_root) -> SftExamples:
    """The examples of a records path, tokenized into the cache or reused from it."""
    settings.check()
    path = Path(path)
    records_form(path, "conversations")
    name = f"sft-{tokenizer.name}-{cache_key(path, tokenizer, settings)}"
    out, built = cached_dir(Path(cache_root), name, lambda staging: _build(path, tokenizer, settings, staging))
    return SftExamples(out, settings.seq_len, built)


def cache_key(path: Path, tokenizer, settings: SftSettings, version: int = _VERSION) -> str:
    """A fingerprint of the data's bytes, the template, the tokenizer, the settings and `version`
    (of the stored format)."""
    template = chat.ChatTemplate.for_tokenizer(tokenizer).key
    key = {
        "version": version,
        "template": template,
        "file": fingerprint(path),
        "tokenizer": tokenizer.fingerprint(),
        "settings": dataclasses.asdict(settings),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _build(path: Path, tokenizer, settings: SftSettings, staging: Path) -> None:
    # Everything is checked before anything is written: data that fails leaves no entry.
    examples, stats = tokenize_file(path, tokenizer, settings)
    check_stats(path, stats, settings)
    staging.mkdir(parents=True, exist_ok=True)  # may hold files of an interrupted build: overwritten
    lengths = [len(ids) for ids, _ in examples]
    np.save(staging / "tokens.npy", np.concatenate([ids for ids, _ in examples]).astype(np.int32))
    np.save(staging / "weights.npy", np.concatenate([w for _, w in examples]).astype(np.uint8))
    np.save(staging / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    write_json(staging / "stats.json", stats)


def tokenize_file(path: Path, tokenizer, settings: SftSettings) -> tuple[list, dict]:
    """([(ids, weights)] of the kept examples, counts).

    examples_read = examples_kept + dropped_too_long + skipped_empty_mask + skipped_bad_records,
    counting the examples the records render to (a conversation gives one more per turn trained
    from its own prefix: turns_own_prefix); turns_trained counts the assistant turns of the kept
    examples; truncated_prompt / truncated_response count kept examples that were cut;
    total_tokens and response_tokens count the kept examples' predictions and those in the loss.
    """
    template = chat.ChatTemplate.for_tokenizer(tokenizer)
    stats = dict.fromkeys(STAT_KEYS, 0)
    examples = []

    def bad(error):  # a record that is not an example: an error, or skipped and counted
        if settings.on_bad_record == "error":
            raise error
        stats["examples_read"] += 1
        stats["skipped_bad_records"] += 1

    def render(record):
        messages, since = sft_example(record)
        return template.examples(messages, settings.train_on, since) or [_NOTHING]

    for _, rendered in iter_records(path, render, expected=ONE_OBJECT, on_error=bad):
        for ids, weights, turns, own_prefix in rendered:
            stats["examples_read"] += 1
            fitted = fit(ids, weights, settings)
            if fitted is None:
                stats["dropped_too_long"] += 1
            elif not fitted[1][1:].any():
                stats["skipped_empty_mask"] += 1
            else:
                stats["examples_kept"] += 1
                stats["turns_trained"] += turns
                stats["turns_own_prefix"] += int(own_prefix)
                if len(fitted[0]) < len(ids):
                    stats["truncated_prompt" if settings.truncation == "cut_prompt_left" else "truncated_response"] += 1
                stats["total_tokens"] += len(fitted[0]) - 1
                stats["response_tokens"] += int(fitted[1][1:].sum())
                examples.append(fitted)
    if stats["turns_own_prefix"]:
        print(
            f"sft data {path}: the chat template renders earlier assistant turns otherwise once the "
            f"conversation goes on (e.g. drops their reasoning); {stats['turns_own_prefix']:,} of "
            f"{stats['turns_trained']:,} trained turns were each trained from its own prefix, as an example of its own",
            file=sys.stderr,
            flush=True,
        )
    return examples, stats


def fit(ids: np.ndarray, weights: np.ndarray, settings: SftSettings):
    """The example cut to at most seq_len + 1 tokens by the truncation policy, or None if dropped."""
    keep = settings.seq_len + 1
    if len(ids) <= keep:
        return ids, weights
    if settings.truncation == "drop":
        return None
    if settings.truncation == "cut_prompt_left":
        return ids[-keep:], weights[-keep:]
    return ids[:keep], weights[:keep]


def check_stats(path: Path, stats: dict, settings: SftSettings) -> None:
    """Fails on a file that yields nothing to train on, or too many all-zero loss masks."""
    read, empty = stats["examples_read"], stats["skipped_empty_mask"]
    if read and empty / read > settings.max_skipped_fraction:
        raise UserError(
            f"{path}: {empty} of {read} examples ({empty / read:.1%}) have no assistant token left after "
            f"truncation='{settings.truncation}' at seq_len={settings.seq_len} (limit max_skipped_fraction="
            f"{settings.max_skipped_fraction}); raise data.seq_len or change the truncation policy"
        )
    if stats["examples_kept"] == 0:
        raise UserError(
            f"{path}: no usable example ({describe(stats)}); expected records with "
            "'messages', 'prompt' and 'completion', or 'instruction' and 'output' that fit data.seq_len"
        )


def describe(stats: dict) -> str:
    """One line for logs: what was kept and why the rest was not."""
    return ", ".join(f"{k} {stats[k]:,}" for k in STAT_KEYS)
