"""Log-likelihoods of continuations under a model on its mesh: the core that bits per byte,
multiple choice and the lm-evaluation-harness adapter all score with.

A request is (context ids, continuation ids). Its row is context + continuation, the last
`max_len + 1` tokens of it when longer (the context is cut from the left first); the targets of
the continuation are counted. Requests are sorted by length, batched into fixed [B, T] shapes
(T rounded up to a multiple of 64, so few shapes compile) and scored by one jitted pass that
returns per row: the summed log-prob, whether greedy decoding reproduces every counted token,
how many tokens were counted, and the UTF-8 bytes they stand for (for bits per byte).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import rules_table
from lm.data.pipeline import BATCH_DTYPES
from lm.errors import UserError
from lm.infer.session import place_params
from lm.model.apply import logits_of, target_logprobs
from lm.model.build import build_model
from lm.sharding import BatchPlacer, batch_shardings

LENGTH_QUANTUM = 64  # row lengths are rounded up to a multiple of this: one compile per bucket


def token_bytes(tokenizer) -> np.ndarray:
    """[vocab] int32: the UTF-8 bytes each id stands for; 0 for control ids (BOS, EOS, PAD, roles),
    which therefore count in neither the nats nor the bytes of bits per byte."""
    return np.asarray(tokenizer.token_bytes(), np.int32)


@dataclasses.dataclass(frozen=True)
class Score:
    """One request's result: summed log p of the counted continuation tokens (nats), whether the
    argmax at every counted position is the target, how many were counted, their bytes, the nats
    of the text tokens alone (control tokens excluded, for bits per byte), and whether the row was
    cut to fit the model (then fewer tokens than the continuation's were counted)."""

    logp: float
    greedy: bool
    tokens: int
    bytes: int
    text_nats: float
    truncated: bool


def _row(context, continuation, max_len: int) -> tuple[np.ndarray, int, bool]:
    ids = np.concatenate([np.asarray(context, np.int32), np.asarray(continuation, np.int32)])
    cut = len(ids) > max_len + 1
    if cut:
        ids = ids[-(max_len + 1) :]
    return ids, min(len(continuation), len(ids) - 1), cut


class Scorer:
    """Scores requests with `model` and `params` placed on `mesh` (the rule table `rules`)."""

    def __init__(self, model, params, tokenizer, *, mesh, rules, batch_size: int = 16, max_len: int | None = None):
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.mesh, self.rules, self.batch_size = mesh, rules, batch_size
        self.max_len = max_len or model.spec.max_seq_len
        self.bytes_table = jnp.asarray(_padded(token_bytes(tokenizer), model.spec.vocab_size))
        # replicated results: every process of a multi-host mesh reads all rows
        self._score_rows = jax.jit(
            functools.partial(_score_rows, model), out_shardings=NamedSharding(mesh, PartitionSpec())
        )

    @classmethod
    def from_loaded(cls, loaded, batch_size: int | None = None, config=None, quantize: str | None = None) -> "Scorer":
        """A trained model (lm.store.load.Loaded) on the mesh of `config` (default: its own),
        weight-quantized when asked (int8, int4)."""
        config = config or loaded.config
        built = build_model(config, rules=rules_table(config))
        batch_size = batch_size or config.eval.batch_size
        if batch_size % built.batch_shards():
            raise UserError(
                f"eval.batch_size={batch_size} must divide evenly over the {built.batch_shards()} "
                f"batch shards of mesh {dict(built.mesh.shape)}"
            )
        built.check(loaded.params, loaded.source)
        return cls(
            built.module,
            place_params(built, loaded.params, quantize),
            loaded.tokenizer,
            mesh=built.mesh,
            rules=built.rules,
            batch_size=batch_size,
        )

    def score(self, requests: list, progress=None) -> list[Score]:
        """Scores of (context ids, continuation ids) requests, in their order. progress: called
        with the number of requests done after each batch."""
        if not requests:
            return []
        for i, (ctx, cont) in enumerate(requests):
            if len(cont) == 0 or len(ctx) == 0:
                raise ValueError(f"request {i}: context and continuation need at least one token each")
        rows = [_row(c, x, self.max_len) for c, x in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[Score | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = self._batch([rows[i] for i in chunk])
            got = jax.device_get(self._scores(batch))
            for j, i in enumerate(chunk):
                out[i] = Score(
                    float(got["logp"][j]),
                    bool(got["greedy"][j]),
                    int(got["tokens"][j]),
                    int(got["bytes"][j]),
                    float(got["text_nats"][j]),
                    rows[i][2],
                )
            if progress is not None:
                progress(len(chunk))
        return out

    def rolling(self, docs: list, prefix: int | None = None, progress=None) -> list[Score]:
        """Every token of each document scored in windows of max_len predictions (consecutive
        windows share one token, as the pretraining pipeline cuts documents). prefix: a token put
        before each document so its first token is scored too (None: the first token is context)."""
        requests, owner = [], []
        for d, doc in enumerate(docs):
            ids = ([prefix] if prefix is not None else []) + [int(t) for t in doc]
            for start in range(0, max(len(ids) - 1, 0), self.max_len):
                requests.append((ids[start : start + 1], ids[start + 1 : start + 1 + self.max_len]))
                owner.append(d)
        totals = [[0.0, True, 0, 0, 0.0] for _ in docs]
        for d, s in zip(owner, self.score(requests, progress)):
            t = totals[d]
            t[0] += s.logp
            t[1] &= s.greedy
            t[2] += s.tokens
            t[3] += s.bytes
            t[4] += s.text_nats
        return [Score(*t, truncated=False) for t in totals]

    def _batch(self, rows) -> dict:
        width = max(len(ids) - 1 for ids, _, _ in rows)
        t = min(-(-width // LENGTH_QUANTUM) * LENGTH_QUANTUM, self.max_len)
        b = self.batch_size
        out = {k: np.zeros((b, t), dt) for k, dt in BATCH_DTYPES.items()}
        for r, (ids, counted, _) in enumerate(rows):
            n = len(ids) - 1
            out["inputs"][r, :n], out["targets"][r, :n] = ids[:-1], ids[1:]
            out["loss_mask"][r, n - counted : n] = 1.0
            out["segment_ids"][r, :n] = 1
            out["positions"][r, :n] = np.arange(n)
        signature = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in out.items()}
        return BatchPlacer(batch_shardings(self.mesh, self.rules, signature), b).from_global(out)

    def _scores(self, batch):
        return self._score_rows(self.params, batch, self.bytes_table)


def _score_rows(model, params, batch, bytes_table):
    """Per row: summed log p, all-greedy, counted tokens, their bytes and text nats."""
    logits = logits_of(model, params, batch)
    logp, _ = target_logprobs(logits, batch["targets"])
    mask = batch["loss_mask"] > 0
    hit = jnp.argmax(logits, axis=-1) == batch["targets"]
    n_bytes = bytes_table[batch["targets"]] * mask
    return {
        "logp": jnp.sum(jnp.where(mask, logp, 0.0), -1),
        "greedy": jnp.all(hit | ~mask, -1),
        "tokens": jnp.sum(mask, -1),
        "bytes": jnp.sum(n_bytes, -1),
        "text_nats": jnp.sum(jnp.where(n_bytes > 0, -logp, 0.0), -1),
    }


def _padded(table: np.ndarray, size: int) -> np.ndarray:
    """The table over the model's vocabulary (which may be larger than the tokenizer's)."""
    out = np.zeros(max(size, len(table)), np.int32)
    out[: len(table)] = table
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a text request, each encoded on its own. Trailing
    whitespace of the context moves to the continuation (" Paris" is scored as one word, as
    lm-evaluation-harness does); an empty context becomes the end-of-text token."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    ctx = [int(t) for t in tokenizer.encode(stripped)] if stripped else [int(tokenizer.eos_id)]
    return ctx, [int(t) for t in tokenizer.encode(continuation)]
