"""Held-out language-modelling sets: loss, perplexity and bits per byte.

A set is a text file (one document), a JSONL file of {"text"} lines (one document each), a
corpus spec (`stdlib`, a directory, a glob: one document per file) or token shards written by
`lm tokenize` (a split directory, or the output directory: its held-out split). A document is scored as pretraining
sees it: its tokens and an end-of-text token, every token after the first predicted, in windows
of the model's context (consecutive windows share one token, so nothing is scored twice).

loss and perplexity are per predicted token (the end-of-text prediction included: the same
number as the training loop's held-out loss). Bits per byte divides the nats of the text tokens
by ln 2 and by the UTF-8 bytes those tokens spell (control tokens count in neither), so models
with different tokenizers compare.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np

from lm.data.corpus import iter_documents, resolve_corpus
from lm.data.shards import is_shard_dir, open_shards
from lm.errors import UserError
from lm.eval.taskfile import read_task_file


@dataclasses.dataclass
class Documents:
    ids: list[np.ndarray]  # token ids per document, end-of-text included
    example_ids: list[int]  # per document: its line (JSONL) or index
    truncated: int = 0  # documents left out by the token limit (after the one it cut)


def read_set(spec: str, tokenizer, max_tokens: int = 0) -> Documents:
    """The documents of a set, tokenized; at most `max_tokens` tokens (0 = all) in file order (the
    document that crosses the limit is cut there; those past it are counted in `truncated`)."""
    path = pathlib.Path(spec)
    if is_shard_dir(spec):  # an `lm tokenize` output: its held-out split
        path = path / "heldout"
    if (path / "manifest.json").is_file():
        shards = open_shards(path, tokenizer)
        docs = (np.asarray(shards.doc(i), np.int32) for i in range(shards.n_docs))
        return _limited(docs, shards.n_docs, max_tokens, spec)
    if path.is_file() and path.suffix == ".jsonl":
        texts = list(_jsonl_texts(path))
    elif path.is_file():
        texts = [(1, path.read_text(encoding="utf-8", errors="replace"))]
    else:
        _, files = resolve_corpus(spec, "eval set")
        texts = [
            (i, d if isinstance(d, str) else d.decode("utf-8", errors="replace"))
            for i, d in enumerate((doc for f in files for doc, _ in iter_documents(f)), 1)
        ]
    texts = [(n, t) for n, t in texts if t]
    if not texts:
        raise UserError(f"eval set '{spec}': no text to score (empty file or corpus)")
    eos = np.asarray([tokenizer.eos_id], np.int32)
    docs = ((n, np.concatenate([tokenizer.encode(t).astype(np.int32), eos])) for n, t in texts)
    return _limited(docs, len(texts), max_tokens, spec, numbered=True)


def _jsonl_texts(path: pathlib.Path):

    for n, obj in read_task_file(path):
        if not isinstance(obj.get("text"), str):
            raise UserError(f"{path}:{n}: expected a JSON object with a string 'text' field")
        yield n, obj["text"]


def _limited(docs, total: int, max_tokens: int, spec: str, numbered: bool = False) -> Documents:
    """Documents in order up to max_tokens tokens: the one that crosses the limit is cut there."""
    out, ids, used = [], [], 0
    for i, doc in enumerate(docs):
        n, d = doc if numbered else (i, doc)
        if max_tokens and used + len(d) > max_tokens:
            if max_tokens - used >= 2:
                out.append(d[: max_tokens - used])
                ids.append(n)
            break
        out.append(d)
        ids.append(n)
        used += len(d)
    if not any(len(d) > 1 for d in out):
        raise UserError(f"eval set '{spec}': no document has a token to predict")
    return Documents(out, ids, total - len(out))


def score_set(scorer, docs: Documents, progress=None) -> dict:
    """{'metrics': loss, perplexity, bits_per_byte, tokens, bytes; 'per_example': nats, tokens,
    text_nats, bytes per document}."""
    scores = scorer.rolling(docs.ids, prefix=None, progress=progress)
    per = {
        "nats": [-s.logp for s in scores],
        "tokens": [s.tokens for s in scores],
        "text_nats": [s.text_nats for s in scores],
        "bytes": [s.bytes for s in scores],
    }
    return {
        "metrics": lm_metrics(per),
        "per_example": per,
        "example_ids": docs.example_ids,
        "n": len(scores),
        "left_out": docs.truncated,
    }


def lm_metrics(per: dict, keep=None) -> dict:
    """Totals of per-document nats/tokens/bytes (over the indices in `keep`, default all)."""
    pick = (
        (lambda k: np.asarray(per[k], np.float64)) if keep is None else (lambda k: np.asarray(per[k], np.float64)[keep])
    )
    tokens, n_bytes = pick("tokens").sum(), pick("bytes").sum()
    loss = pick("nats").sum() / max(tokens, 1)
    return {
        "loss": float(loss),
        "perplexity": float(math.exp(min(loss, 700))),
        "bits_per_byte": float(pick("text_nats").sum() / math.log(2) / max(n_bytes, 1)),
        "tokens": int(tokens),
        "bytes": int(n_bytes),
    }
