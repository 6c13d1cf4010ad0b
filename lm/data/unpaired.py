"""Unpaired examples for KTO: {"prompt", "completion", "label"} -> tokenized rows with a
mismatched twin, cached (for `lm kto`).

The data is a records path (lm.data.records: JSONL, Parquet, Arrow, a datasets folder); each
record is one example, TRL's unpaired preference form:

  {"prompt": STR or MESSAGES, "completion": STR or [ASSISTANT MESSAGE], "label": true | false}

label true marks a desirable completion, false an undesirable one. Each example is rendered with
the one chat template as prompt + completion (`train_on="last"`: the loss mask covers the
completion and its end marker).

KTO's reference point is a KL estimate from mismatched pairs: the same prompt followed by
another example's completion (TRL pairs each prompt with the completion before it in its
batch). Here example i's twin is its prompt with the completion of the kept example before it
(the first takes the last's), fixed when the cache is built. The two rows are stored as a pair
([N, 2, L+1]: row 0 the example, row 1 its twin), so they travel together through batches and
the pair machinery (lm.data.preference.PairExamples), and `label` (1.0 or 0.0) stands where a
pair has its margin. A twin longer than seq_len is cut at its end; one left with no completion
token is empty (padding) and leaves the estimate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lm.data import chat
from lm.data.cache import cached_dir
from lm.data.conversations import prompt_messages, response_message
from lm.data.preference import PairExamples, read_pairs
from lm.data.records import ONE_OBJECT, iter_records, records_form
from lm.data.sft import SftSettings, cache_key, fit
from lm.data.tokens import write_json
from lm.errors import UserError

_VERSION = 1  # bump when the stored rows change for the same inputs and settings
STAT_KEYS = (
    "examples_read",
    "examples_kept",
    "desirable",
    "undesirable",
    "dropped_too_long",
    "skipped_empty_mask",
    "skipped_bad_records",
    "twins_cut",
    "twins_empty",
    "total_tokens",
)


class UnpairedExamples(PairExamples):
    """Random access to cached examples: i -> the pair fields ([2, L]: the example, its twin) and
    `label` (1.0 desirable, 0.0 undesirable)."""

    def __getitem__(self, i: int) -> dict:
        row = super().__getitem__(i)
        row["label"] = row.pop("margin")
        return row

    def __repr__(self) -> str:
        return f"UnpairedExamples('{self.path}', {len(self)} examples)"


def parse_unpaired(record) -> tuple[list[dict], dict, bool]:
    """One record -> (prompt messages, completion message, label); ValueError naming what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}; expected an object with 'prompt', 'completion', 'label'")
    for key in ("prompt", "completion", "label"):
        if key not in record:
            raise ValueError(
                f"no '{key}' (keys: {', '.join(sorted(record))}); an example needs 'prompt', 'completion' and 'label'"
            )
    label = record["label"]
    if not isinstance(label, bool):
        raise ValueError(f"'label' is {label!r}; expected true (desirable) or false (undesirable)")
    return prompt_messages(record["prompt"]), response_message(record, "completion"), label


def prepare_unpaired(path, tokenizer, settings: SftSettings, cache_root) -> UnpairedExamples:
    """The examples of a records path with their twins, tokenized into the cache or reused from it."""
    settings.check()
    path = Path(path)
    records_form(path, "unpaired examples")
    name = f"unpaired-{tokenizer.name}-{cache_key(path, tokenizer, settings, _VERSION)}"
    out, built = cached_dir(Path(cache_root), name, lambda staging: _build(path, tokenizer, settings, staging))
    return UnpairedExamples(out, settings.seq_len, built)


def _build(path: Path, tokenizer, settings: SftSettings, staging: Path) -> None:
    examples, stats = tokenize_file(path, tokenizer, settings)
    check_stats(path, stats, settings)
    staging.mkdir(parents=True, exist_ok=True)
    n, width = len(examples), settings.seq_len + 1
    tokens, weights = np.zeros((n, 2, width), np.int32), np.zeros((n, 2, width), np.uint8)
    lengths, labels = np.zeros((n, 2), np.int32), np.zeros((n,), np.float32)
    for i, (sides, label) in enumerate(examples):
        for s, (ids, w) in enumerate(sides):
            tokens[i, s, : len(ids)], weights[i, s, : len(ids)], lengths[i, s] = ids, w, len(ids)
        labels[i] = label
    # PairExamples reads the per-row float as "margins"; UnpairedExamples hands it out as `label`
    for name, array in (("tokens", tokens), ("weights", weights), ("lengths", lengths), ("margins", labels)):
        np.save(staging / f"{name}.npy", array)
    write_json(staging / "stats.json", stats)


def tokenize_file(path: Path, tokenizer, settings: SftSettings) -> tuple[list, dict]:
    """([((example ids, weights), (twin ids, weights)), label] of the kept examples, counts).

    examples_read = examples_kept + dropped_too_long + skipped_empty_mask + skipped_bad_records."""
    template = chat.ChatTemplate.for_tokenizer(tokenizer)
    stats = dict.fromkeys(STAT_KEYS, 0)
    kept = []  # (prompt messages, completion message, label, fitted example)

    def bad(error):
        if settings.on_bad_record == "error":
            raise error
        stats["examples_read"] += 1
        stats["skipped_bad_records"] += 1

    for _, (prompt, completion, label) in iter_records(path, parse_unpaired, expected=ONE_OBJECT, on_error=bad):
        stats["examples_read"] += 1
        fitted = fit(*template.render(prompt + [completion], "last"), settings)
        if fitted is None:
            stats["dropped_too_long"] += 1
        elif not fitted[1][1:].any():
            stats["skipped_empty_mask"] += 1
        else:
            stats["examples_kept"] += 1
            stats["desirable" if label else "undesirable"] += 1
            stats["total_tokens"] += len(fitted[0]) - 1
            kept.append((prompt, completion, label, fitted))
    out = []
    for i, (prompt, _, label, fitted) in enumerate(kept):
        other = kept[i - 1][1]  # the completion before it (the first takes the last's)
        ids, w = template.render(prompt + [other], "last")
        keep = settings.seq_len + 1
        if len(ids) > keep:
            stats["twins_cut"] += 1
            ids, w = ids[:keep], w[:keep]
        if not w[1:].any():
            stats["twins_empty"] += 1
            ids, w = ids[:0], w[:0]
        out.append(((fitted, (ids, w)), float(label)))
    return out, stats


def check_stats(path: Path, stats: dict, settings: SftSettings) -> None:
    """Fails on a file that yields no example, or too many left with no completion token."""
    read, empty = stats["examples_read"], stats["skipped_empty_mask"]
    if read and empty / read > settings.max_skipped_fraction:
        raise UserError(
            f"{path}: {empty} of {read} examples ({empty / read:.1%}) have no completion token left after "
            f"truncation='{settings.truncation}' at seq_len={settings.seq_len} (limit finetune.max_skipped_fraction="
            f"{settings.max_skipped_fraction}); raise data.seq_len or change finetune.truncation"
        )
    if stats["examples_kept"] == 0:
        raise UserError(
            f"{path}: no usable example ({describe(stats)}); expected records with 'prompt', "
            "'completion' and 'label' (true or false) that fit data.seq_len"
        )


def describe(stats: dict) -> str:
    """One line for logs: what was kept and why the rest was not."""
    return ", ".join(f"{k} {stats[k]:,}" for k in STAT_KEYS)


def unpaired_from_pairs(pairs_path, out_path) -> int:
    """Preference pairs (lm.data.preference) as unpaired examples: each pair's chosen response
    labelled true and its rejected one false, in JSONL; returns the examples written."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"prompt": prompt, "completion": response["content"], "label": label})
        for prompt, chosen, rejected, _ in read_pairs(pairs_path)
        for response, label in ((chosen, True), (rejected, False))
    ]
    out.write_text("".join(line + "\n" for line in lines))
    return len(lines)
