"""Prompts for RL (`lm rl`): records -> chat prompts as token ids, and their other fields.

The prompts are a records path (lm.data.records: JSONL, Parquet, Arrow, a datasets folder). A
record is either {"prompt": str | chat messages, ...} (TRL's prompt column, standard or
conversational) or a chat record {"messages": [...]} whose trailing assistant turn is taken as
the reference answer (the column `answer`), so an `lm sft` file doubles as an RL prompt set.
Every other key of the record is a column that reward functions receive (e.g. "answer").
Prompts are rendered with the chat template and an open assistant turn (lm.data.chat.prompt_ids).

Bad records (malformed JSON, no prompt) and prompts leaving no room for `max_new_tokens` in
`seq_len` are errors naming file and row, or skipped and counted with on_bad_record=skip;
a set of which more than max_skipped_fraction is skipped fails.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from lm.data import provenance
from lm.data.chat import ChatTemplate, prompt_ids
from lm.data.conversations import prompt_messages
from lm.data.records import ONE_OBJECT, fingerprint, iter_records, records_form
from lm.errors import UserError


@dataclasses.dataclass
class PromptSet:
    """Prompts as padded ids [N, L] with lengths, the raw prompt (string or messages) as in the
    file, its chat messages and the record's other keys (columns)."""

    path: str
    ids: np.ndarray  # int32 [N, max_len], zero after each prompt
    lengths: np.ndarray  # int32 [N]
    prompts: list
    messages: list[list[dict]]
    columns: list[dict]
    stats: dict

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        """A row of the prompt stream (lm.data.pipeline.train_dataset with pack=False): its index."""
        return {"index": np.int32(i)}

    def tokens(self, i: int) -> list[int]:
        return self.ids[i, : self.lengths[i]].tolist()

    def example(self, i: int) -> dict:
        """Prompt i as an RL environment's example (lm.train.environments): its chat messages and columns."""
        return {"messages": self.messages[i], **self.columns[i]}


def parse_prompt(record) -> tuple[object, list[dict], dict]:
    """One record -> (raw prompt, its chat messages, the other columns);
    ValueError saying what was expected."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}; expected an object with 'prompt' or 'messages'")
    if "prompt" in record:
        columns = {k: v for k, v in record.items() if k != "prompt"}
        return record["prompt"], prompt_messages(record["prompt"]), columns
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of chat messages")
        columns = {k: v for k, v in record.items() if k != "messages"}
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            columns.setdefault("answer", last.get("content"))
            messages = messages[:-1]
        return messages, prompt_messages(messages), columns
    raise ValueError(f"keys {sorted(record)}; expected 'prompt' (a string or chat messages) or 'messages'")


def read_prompts(
    path,
    tokenizer,
    *,
    seq_len: int,
    max_new_tokens: int,
    on_bad_record: str = "error",
    max_skipped_fraction: float = 0.01,
    limit: int = 0,
) -> PromptSet:
    """The first `limit` (0 = all) usable prompts of a records path."""
    path = pathlib.Path(path)
    records_form(path, "prompts")
    provenance.note("prompts", fingerprint(path)[:16])
    template = ChatTemplate.for_tokenizer(tokenizer)
    room = seq_len - max_new_tokens
    if room < 1:
        raise UserError(f"rl.max_new_tokens={max_new_tokens} leaves no room for a prompt in data.seq_len={seq_len}")
    stats = {"prompts_read": 0, "prompts_kept": 0, "skipped_bad_records": 0, "skipped_too_long": 0}
    ids, raw, chats, columns = [], [], [], []

    def bad(error):
        stats["prompts_read"] += 1
        _bad(str(error), on_bad_record, stats, "skipped_bad_records")

    def parse(record):  # a UserError on the way counts as a bad line too
        try:
            prompt, messages, cols = parse_prompt(record)
            return prompt, messages, cols, prompt_ids(template, messages)
        except UserError as e:
            raise ValueError(str(e)) from None

    for n, (prompt, messages, cols, tokens) in iter_records(path, parse, expected=ONE_OBJECT, on_error=bad):
        stats["prompts_read"] += 1
        if len(tokens) > room:
            _bad(
                f"{path}:{n}: the prompt has {len(tokens)} tokens; at most {room} fit before "
                f"rl.max_new_tokens={max_new_tokens} new ones in data.seq_len={seq_len}",
                on_bad_record,
                stats,
                "skipped_too_long",
            )
            continue
        ids.append(tokens), raw.append(prompt), chats.append(messages), columns.append(cols)
        if limit and len(ids) >= limit:
            break
    stats["prompts_kept"] = len(ids)
    skipped = stats["skipped_bad_records"] + stats["skipped_too_long"]
    if not ids:
        raise UserError(
            f"{path}: no usable prompt ({describe(stats)}); expected records with 'prompt' "
            "or 'messages' whose prompt fits data.seq_len - rl.max_new_tokens"
        )
    if skipped > max_skipped_fraction * stats["prompts_read"]:
        raise UserError(
            f"{path}: {skipped} of {stats['prompts_read']} prompts skipped ({describe(stats)}), more "
            f"than finetune.max_skipped_fraction={max_skipped_fraction}; fix the file or raise data.seq_len"
        )
    width = max(len(t) for t in ids)
    padded = np.zeros((len(ids), width), np.int32)
    for i, t in enumerate(ids):
        padded[i, : len(t)] = t
    lengths = np.array([len(t) for t in ids], np.int32)
    return PromptSet(str(path), padded, lengths, raw, chats, columns, stats)


def _bad(message: str, on_bad_record: str, stats: dict, key: str) -> None:
    if on_bad_record != "skip":
        raise UserError(message + " (finetune.on_bad_record=skip skips and counts such records)")
    stats[key] += 1


def describe(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.items())
