"""Supervised fine-tuning examples: JSONL conversations -> tokenized, masked, cached examples.

Each non-blank line is one example, in either format (detected per line):

  chat         {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  instruction  {"instruction": str, "input": str (optional), "output": str, "system": str (optional)}

An instruction becomes a user turn (instruction, then "\\n\\n" + input when input is
non-empty) and an assistant turn (output). Examples are rendered with the one chat
template (`lm.data.chat`): the loss covers the assistant turns only.

An example of n tokens holds n-1 predictions; it fits a row when n-1 <= seq_len.
Longer ones are dropped or cut (`SftSettings.truncation`), and every outcome is
counted. An example left with no token to learn from is skipped, and too many of
those is an error: a run must never train on silently empty masks.

The result is cached (`lm.data.cache`) under a name fingerprinting the file's
bytes, the tokenizer and the settings, as memory-mapped .npy files:

  tokens.npy   int32, every example's ids back to back
  weights.npy  uint8, the loss weight of each token (0 or 1)
  offsets.npy  int64, start of each example, plus the total: n_examples + 1
  stats.json   the counts (see `tokenize_file`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from lm.config.sft import SftSettings
from lm.data import chat
from lm.data.cache import cached_dir
from lm.data.jsonl import ONE_OBJECT, iter_jsonl
from lm.data.tokens import write_json
from lm.errors import UserError

_VERSION = 1  # bump when the stored examples change for the same inputs and settings
STAT_KEYS = (
    "examples_read",
    "examples_kept",
    "dropped_too_long",
    "truncated_prompt",
    "truncated_response",
    "skipped_empty_mask",
    "skipped_bad_records",
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
    """The examples of a JSONL file, tokenized into the cache or reused from it."""
    settings.check()
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sft data: '{path}' is not a file; expected a JSONL file of conversations")
    name = f"sft-{tokenizer.name}-{cache_key(path, tokenizer, settings)}"
    out, built = cached_dir(Path(cache_root), name, lambda staging: _build(path, tokenizer, settings, staging))
    return SftExamples(out, settings.seq_len, built)


def cache_key(path: Path, tokenizer, settings: SftSettings, version: int = _VERSION) -> str:
    """A fingerprint of the file's bytes, the template, the tokenizer, the settings and `version`
    (of the stored format)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    template = chat.ChatTemplate.for_tokenizer(tokenizer).key
    key = {
        "version": version,
        "template": template,
        "file": digest.hexdigest(),
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

    examples_read = examples_kept + dropped_too_long + skipped_empty_mask + skipped_bad_records;
    truncated_prompt / truncated_response count kept examples that were cut; total_tokens and
    response_tokens count the kept examples' predictions and those in the loss.
    """
    template = chat.ChatTemplate.for_tokenizer(tokenizer)
    stats = dict.fromkeys(STAT_KEYS, 0)
    examples = []

    def bad(error):  # a line that is not an example: an error, or skipped and counted
        if settings.on_bad_record == "error":
            raise error
        stats["examples_read"] += 1
        stats["skipped_bad_records"] += 1

    def render(record):
        return template.render(parse_record(record), settings.train_on)

    for _, (ids, weights) in iter_jsonl(path, render, expected=ONE_OBJECT, on_error=bad):
        stats["examples_read"] += 1
        fitted = fit(ids, weights, settings)
        if fitted is None:
            stats["dropped_too_long"] += 1
        elif not fitted[1][1:].any():
            stats["skipped_empty_mask"] += 1
        else:
            stats["examples_kept"] += 1
            if len(fitted[0]) < len(ids):
                stats["truncated_prompt" if settings.truncation == "cut_prompt_left" else "truncated_response"] += 1
            stats["total_tokens"] += len(fitted[0]) - 1
            stats["response_tokens"] += int(fitted[1][1:].sum())
            examples.append(fitted)
    return examples, stats


def parse_record(record) -> list[dict]:
    """One JSONL record (a line's JSON value) -> chat messages; ValueError saying what was wrong
    and what was expected."""
    if not isinstance(record, dict):
        raise ValueError(
            f"a JSON {type(record).__name__}; expected an object with 'messages' (chat) "
            "or 'instruction' and 'output' (instruction)"
        )
    if "messages" in record:
        return record["messages"]
    if "instruction" in record or "output" in record:
        return _instruction_messages(record)
    raise ValueError(f"keys {sorted(record)}; expected 'messages' (chat) or 'instruction' and 'output' (instruction)")


def _instruction_messages(record: dict) -> list[dict]:
    for key, required in (("instruction", True), ("output", True), ("input", False), ("system", False)):
        if key not in record:
            if required:
                raise ValueError(f"no '{key}'; an instruction record needs 'instruction' and 'output' strings")
        elif not isinstance(record[key], str):
            raise ValueError(f"'{key}' is {type(record[key]).__name__}; expected a string")
    for key in ("instruction", "output"):
        if not record[key]:
            raise ValueError(f"'{key}' is empty; expected a non-empty string")
    user = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []  # "" = none
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


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
            f"{path}: no usable example ({describe(stats)}); expected JSONL lines with "
            "'messages' or 'instruction' and 'output' that fit data.seq_len"
        )


def describe(stats: dict) -> str:
    """One line for logs: what was kept and why the rest was not."""
    return ", ".join(f"{k} {stats[k]:,}" for k in STAT_KEYS)
