"""Sentencepiece BPE tokenizer: training and loading.

Settings chosen for code: byte fallback (no unknown tokens), identity normalisation
and no whitespace collapsing or dummy prefix (so decode(encode(x)) == x), digits
split, whitespace-only pieces allowed, and whole documents as training
"sentences" so that newlines and indentation become pieces.

Special tokens (pad, bos, eos and the chat roles) are *control* symbols: a single
id each, dropped by decode, and never produced by encoding text, even text that
contains the literal "<|user|>" or "<s>" (user_defined symbols would be matched).

Sentencepiece spells the space as U+2581 ("▁") in its pieces and decodes every "▁" of a piece
as " ", so a literal U+2581 in the input would come back as a space. With byte fallback it is
encoded as its three byte pieces instead (<0xE2><0x96><0x81>), which decode to "▁" itself.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Iterable

import numpy as np

from lm.errors import UserError
from lm.outputs import write_bytes

CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>")
SPACE_MARK = "\u2581"  # how sentencepiece spells a space inside its pieces
# Fixed ids for models we train: unk, bos, eos, pad first, then the chat roles.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def _spm():
    import sentencepiece  # imported lazily: the byte tokenizer must not need it

    return sentencepiece


class SentencePieceTokenizer:
    """Any sentencepiece `.model` file (ours or e.g. Llama-2's tokenizer.model).

    bos/eos/pad come from the model. If the model has no pad (pad_id == -1, as in
    Llama-2), pad_id is mapped to the unk id: a valid embedding row that a
    byte-fallback model never emits. bos_id may be -1 if the model has no BOS;
    a model without EOS is rejected (token files separate documents with it).
    """

    def __init__(self, model_path: str | Path):
        self.path = Path(model_path)
        try:
            self._model = self.path.read_bytes()
        except OSError as e:
            raise UserError(f"data.tokenizer: cannot read sentencepiece model '{self.path}': {e}") from e
        self._sp = _spm().SentencePieceProcessor()
        try:  # load from the bytes we hashed, so fingerprint and mapping always agree
            self._sp.LoadFromSerializedProto(self._model)
        except RuntimeError as e:
            raise UserError(f"data.tokenizer: '{self.path}' is not a sentencepiece model: {e}") from e
        self.name = "spm-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.path.stem)  # used in cache dir names
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise UserError(f"data.tokenizer: sentencepiece model '{self.path}' has no EOS token")
        pad = self._sp.pad_id()
        self.pad_id = pad if pad >= 0 else max(self._sp.unk_id(), 0)
        self.train_stats: dict | None = None  # set by train_sentencepiece
        self._space_mark = self._byte_ids(SPACE_MARK)  # None without byte fallback: "▁" decodes as " "

    def encode(self, text: str | bytes) -> np.ndarray:
        # Plain-text pieces only: no BOS/EOS added. Invalid UTF-8 becomes U+FFFD.
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        if SPACE_MARK in text and self._space_mark is not None:
            return self._encode_space_marks(text)
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def _encode_space_marks(self, text: str) -> np.ndarray:
        """A literal "▁" as its byte pieces: encoded as a stand-in character that is no piece (so it
        falls back to bytes, and merges with nothing), whose byte ids are then swapped for those of "▁"."""
        stand_in = next(
            (
                c
                for c in map(chr, range(0xE000, 0xF900))
                if c not in text and self._sp.piece_to_id(c) == self._sp.unk_id()
            ),
            None,
        )  # private-use characters
        stand_in_ids = self._byte_ids(stand_in) if stand_in else None
        if stand_in_ids is None:
            return np.asarray(self._sp.encode(text), dtype=np.int32)
        ids = np.asarray(self._sp.encode(text.replace(SPACE_MARK, stand_in)), dtype=np.int32)
        n = len(stand_in_ids)
        windows = np.lib.stride_tricks.sliding_window_view(ids, n) if len(ids) >= n else np.zeros((0, n))
        for start in np.flatnonzero((windows == stand_in_ids).all(axis=1)):  # UTF-8: these bytes are the stand-in
            ids[start : start + n] = self._space_mark
        return ids

    def _byte_ids(self, char: str) -> np.ndarray | None:
        """The byte-fallback ids of a character's UTF-8 bytes (None if the model has no byte pieces)."""
        ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in char.encode("utf-8")]
        return np.asarray(ids, np.int32) if all(self._sp.is_byte(i) for i in ids) else None

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        return self._sp.decode([int(i) for i in ids])  # control ids decode to ""

    def special_id(self, token: str) -> int:
        """Id of a special token such as "<|user|>"; UserError if the model lacks it."""
        i = self._sp.piece_to_id(token)
        if self._sp.id_to_piece(i) != token:  # piece_to_id answers unk for unknown pieces
            raise UserError(f"data.tokenizer: special token '{token}' is not in '{self.path}'")
        if not self._sp.is_control(i):
            raise UserError(
                f"data.tokenizer: '{token}' in '{self.path}' is an ordinary piece "
                "(plain text could produce it), not a control token"
            )
        return i

    def token_bytes(self) -> np.ndarray:
        """[vocab] int32: bytes per id as sentencepiece itself decodes it; 0 for control, unknown
        and unused ids (BOS, EOS, PAD, roles), which count in neither the nats nor the bytes of
        bits per byte. A "\u2581" in a piece is the space it decodes to (sentencepiece decodes every
        one so; a literal U+2581 of a text is encoded as byte pieces), and byte-fallback pieces
        (<0xNN>) are one byte each. Each id is decoded after a plain piece: decoded first, a piece
        would lose the leading space that a dummy-prefix model (Llama's) strips from a text's start."""
        sp = self._sp
        out = np.zeros(self.vocab_size, np.int32)
        text = [i for i in range(self.vocab_size) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))]
        out[[i for i in text if sp.is_byte(i)]] = 1
        pieces = [i for i in text if not sp.is_byte(i)]
        ref = next(
            (i for i in pieces if SPACE_MARK not in sp.id_to_piece(i) and sp.decode([i]) == sp.id_to_piece(i)), None
        )
        if ref is None:  # no plain piece to lead with: each id alone
            out[pieces] = [len(t.encode("utf-8")) for t in sp.decode([[i] for i in pieces])]
            return out
        lead = len(sp.decode([ref]).encode("utf-8"))
        out[pieces] = [len(t.encode("utf-8")) - lead for t in sp.decode([[ref, i] for i in pieces])]
        return out

    def fingerprint(self) -> str:
        return "spm:" + hashlib.sha256(self._model).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer('{self.path}')"


def _select_docs(docs, max_bytes: int, max_doc_bytes: int) -> tuple[list[str], dict]:
    """Whole documents, in order, until max_bytes; over-long ones counted and skipped.

    sentencepiece itself would skip documents longer than max_sentence_length
    silently, so we do it here and say how many.
    """
    kept, stats = (
        [],
        {"docs_used": 0, "bytes_used": 0, "skipped_long_docs": 0, "skipped_empty_docs": 0, "hit_max_bytes": False},
    )
    for doc in docs:
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        n = len(text.encode("utf-8"))
        if n == 0:
            stats["skipped_empty_docs"] += 1
        elif n > max_doc_bytes:
            stats["skipped_long_docs"] += 1
        elif stats["bytes_used"] + n > max_bytes:
            stats["hit_max_bytes"] = True  # stop reading: the rest of the input is not consumed
            break
        else:
            kept.append(text)
            stats["docs_used"] += 1
            stats["bytes_used"] += n
    return kept, stats


def _without_thread_count(model: bytes) -> bytes:
    """Drop num_threads from the recorded trainer spec: the pieces do not depend on
    it, and keeping it would make the file (and fingerprint) depend on the machine."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf
    except ImportError:
        return model
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    proto.trainer_spec.ClearField("num_threads")
    return proto.SerializeToString()


def train_sentencepiece(
    docs: Iterable[str | bytes],
    out_prefix: str | Path,
    vocab_size: int,
    max_bytes: int = 50_000_000,
    num_threads: int | None = None,
    max_doc_bytes: int = 1 << 20,
) -> SentencePieceTokenizer:
    """Train a BPE model on whole documents; write `<out_prefix>.model` and `.vocab`.

    Deterministic for the same docs and arguments (no sampling, no shuffling).
    The returned tokenizer's `train_stats` reports docs used/skipped and bytes used.
    """
    out_prefix = Path(out_prefix)
    kept, stats = _select_docs(docs, max_bytes, max_doc_bytes)
    if not kept:
        raise UserError(f"data.tokenizer: no training documents for '{out_prefix}' ({stats})")
    buf = io.BytesIO()
    try:
        _spm().SentencePieceTrainer.train(
            sentence_iterator=iter(kept),
            # Write the model to memory, not to model_prefix: the prefix would be
            # recorded in the model, making the bytes depend on a temp path.
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # a leading "▁" per document would break exact round trips
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=max(len(t.encode("utf-8")) for t in kept),  # every kept doc fits
            input_sentence_size=0,  # use everything: no sampling
            shuffle_input_sentence=False,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            unk_piece="<unk>",
            bos_piece="<s>",
            eos_piece="</s>",
            pad_piece="<pad>",
            control_symbols=list(CHAT_TOKENS),
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=1,
        )
    except RuntimeError as e:  # e.g. vocab_size too small for the byte pieces, or too large
        raise UserError(f"data.tokenizer: sentencepiece training failed for vocab_size={vocab_size}: {e}") from e
    model = _without_thread_count(buf.getvalue())
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    sp = _spm().SentencePieceProcessor(model_proto=model)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    # Each file appears whole or not at all; .model last, so its presence means done.
    write_bytes(out_prefix.with_name(out_prefix.name + ".vocab"), vocab.encode("utf-8"))
    model_path = out_prefix.with_name(out_prefix.name + ".model")
    write_bytes(model_path, model)
    tok = SentencePieceTokenizer(model_path)
    tok.train_stats = stats
    return tok
