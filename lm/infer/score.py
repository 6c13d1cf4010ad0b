"""A reward model (`lm reward`) as a scorer: conversations -> one float each.

A conversation ends with the assistant turn to score; it is rendered with the chat template
exactly as in training (the score is read at the last input token, the response's end
marker). Rows are batched and padded to a multiple of 64 tokens, so few shapes compile.
A conversation longer than the model's context loses its oldest tokens (counted in
`truncated`): the response and the end marker, which the score reads, are kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import rules_table
from lm.data.chat import ChatTemplate
from lm.data.conversations import prompt_messages, sft_messages
from lm.data.records import ONE_OBJECT, read_records
from lm.errors import UserError
from lm.model.apply import sequence_scores
from lm.model.build import build_model, reward_model

BUCKET = 64


class RewardScorer:
    """Builds the reward model of a loaded run (lm.store.load.Loaded holding a 'scalar_head')."""

    def __init__(self, loaded, devices=None, batch_size: int = 32, mesh=None):
        if "scalar_head" not in loaded.params:
            raise UserError(
                f"{loaded.source} has no scalar head: it is not a reward model (train one with `lm reward`)"
            )
        self.loaded, self.template = loaded, ChatTemplate.for_tokenizer(loaded.tokenizer)
        self.built = build_model(
            loaded.config, devices, rules=rules_table(loaded.config), model_fn=reward_model, mesh=mesh
        )
        self.built.check(loaded.params, loaded.source)
        self.params = self.built.place(loaded.params)
        shardings = self.built.batch_shardings({k: (1, 1) for k in ("inputs", "segment_ids", "positions")})
        self.batch_size = -(-batch_size // self.built.batch_shards()) * self.built.batch_shards()
        model = self.built.module
        self._score = jax.jit(
            lambda p, rows: sequence_scores(model, p, rows),
            in_shardings=(self.built.param_shardings, shardings),
            out_shardings=NamedSharding(self.built.mesh, PartitionSpec()),
        )
        self.truncated = 0

    def ids(self, messages: list[dict]) -> np.ndarray:
        """The input ids whose last position the score is read at (the training rows' inputs)."""
        ids = self.template.render(messages, "last")[0][:-1]
        limit = self.built.spec.max_seq_len
        if len(ids) > limit:
            self.truncated += 1
            ids = ids[-limit:]
        return ids

    def score(self, conversations: list[list[dict]]) -> np.ndarray:
        """float32 [N]: each conversation's reward."""
        rows = []
        for i, messages in enumerate(conversations):
            try:
                rows.append(self.ids(messages))
            except ValueError as e:
                raise UserError(f"conversation {i}: {e}") from None
        out = [self._batch(rows[s : s + self.batch_size]) for s in range(0, len(rows), self.batch_size)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _batch(self, rows: list[np.ndarray]) -> np.ndarray:
        t = min(-(-max(len(r) for r in rows) // BUCKET) * BUCKET, self.built.spec.max_seq_len)
        inputs = np.zeros((self.batch_size, t), np.int32)
        segments = np.zeros_like(inputs)
        for i, r in enumerate(rows):
            inputs[i, : len(r)], segments[i, : len(r)] = r, 1
        segments[len(rows) :, 0] = 1  # filler rows: one real token, score ignored
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), inputs.shape) * (segments > 0)
        batch = {
            "inputs": jnp.asarray(inputs),
            "segment_ids": jnp.asarray(segments),
            "positions": jnp.asarray(positions, jnp.int32),
        }
        return np.asarray(jax.device_get(self._score(self.params, batch)))[: len(rows)]


def read_texts(path) -> list[list[dict]]:
    """Conversations to score: records (lm.data.records) {"prompt", "response"} or any `lm sft`
    record (chat messages, prompt/completion or instruction/output) ending with the assistant turn."""

    def conversation(record) -> list[dict]:
        if isinstance(record, dict) and "response" in record:
            response = record["response"]
            if not isinstance(response, str) or not response:
                raise ValueError("'response' must be a non-empty string")
            return prompt_messages(record.get("prompt")) + [{"role": "assistant", "content": response}]
        return sft_messages(record)

    return [c for _, c in read_records(path, conversation, what="conversations to score", expected=ONE_OBJECT)]
