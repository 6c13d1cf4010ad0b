"""Tokenizers: a common interface, the byte-level tokenizer and `load_tokenizer`.

Sentencepiece (training and loading) lives in `lm.data.spm`, Hugging Face tokenizers
(a checkpoint's tokenizer.json) in `lm.data.hf_tokenizer`.

Every tokenizer exposes the same small surface (see `Tokenizer`) so that token
files, the pipeline and the model only ever see ids. `fingerprint()` identifies
the exact id mapping: token files record it, and reading a file with a different
tokenizer fails instead of silently training on wrong ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

from lm.errors import UserError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...
    def decode(self, ids) -> str: ...
    def fingerprint(self) -> str: ...
    def token_bytes(self) -> np.ndarray: ...  # [vocab] int32: UTF-8 bytes per id, 0 for special ids


class ByteTokenizer:
    """Ids 0..255 are raw bytes; 256, 257, 258 are BOS, EOS, PAD.

    Lossless for any input (no unknown tokens), needs no training: the baseline
    and the tokenizer for tests.
    """

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()  # drop specials
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.int32)
        out[:256] = 1
        return out

    def fingerprint(self) -> str:
        # Bump the version if the id mapping ever changes.
        return f"byte-v1:bos={self.bos_id},eos={self.eos_id},pad={self.pad_id},vocab={self.vocab_size}"

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_TOKENIZERS = {"byte": ByteTokenizer}


def load_tokenizer(name: str) -> Tokenizer:
    """Build a tokenizer by name ('byte'), from a sentencepiece `.model` path, or from a directory
    holding a Hugging Face `tokenizer.json` (a checkpoint's, with its tokenizer_config.json)."""
    if name in _TOKENIZERS:
        return _TOKENIZERS[name]()
    known = ", ".join(repr(k) for k in sorted(_TOKENIZERS))
    path = Path(name)
    if path.is_dir() or path.name == "tokenizer.json":
        return _from_directory(path if path.is_dir() else path.parent)
    if name.endswith(".model") or os.sep in name or "/" in name:
        if not path.is_file():
            raise UserError(
                f"data.tokenizer: sentencepiece model '{name}' does not exist; "
                f"give an existing .model file, a directory with a tokenizer.json, or one of: {known}"
            )
        from lm.data.spm import SentencePieceTokenizer  # lazy: needs sentencepiece

        return SentencePieceTokenizer(name)
    raise UserError(
        f"data.tokenizer: unknown tokenizer '{name}'; known: {known}, "
        "a path to a sentencepiece .model file, or a directory with a tokenizer.json"
    )


def _from_directory(path: Path) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        from lm.data.hf_tokenizer import HFTokenizer  # lazy: needs tokenizers

        return HFTokenizer(path)
    if (path / "tokenizer.model").is_file():  # a checkpoint that ships only its sentencepiece model
        from lm.data.spm import SentencePieceTokenizer

        return SentencePieceTokenizer(path / "tokenizer.model")
    raise UserError(
        f"data.tokenizer: directory '{path}' has no tokenizer.json (nor tokenizer.model); "
        "expected a Hugging Face tokenizer directory"
    )
