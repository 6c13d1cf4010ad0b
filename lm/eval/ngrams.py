"""Word n-grams as stable 64-bit hashes, computed for a whole chunk of text at once.

Text is normalised as the contamination check sees it: lowercased, words = runs of `\\w`.
A word's hash is the first 8 bytes of its blake2b digest (the same on every machine and run,
unlike Python's salted `hash`), cached per word. The hash of the k words from position i is a
polynomial in those word hashes with wrap-around uint64 arithmetic, then a final mix; numpy
computes every window of a chunk in k array operations, so no Python loop runs per n-gram.
A window never spans two documents: the chunk carries the document of every word.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

_WORD = re.compile(r"\w+")
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection mod 2**64
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser
_CACHE_WORDS = 4_000_000  # the word cache is emptied beyond this many words (bounded memory)
_NOT_WORD = bytes(c if chr(c).isalnum() or c == ord("_") else ord(" ") for c in range(128)) + b" " * 128


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def fast_words(text: str) -> list[str] | list[bytes]:
    """`words(text)`, as bytes for ASCII text: \\w is then [A-Za-z0-9_], and bytes.translate and
    split run ~3x faster than the regex. Both spellings of a word hash the same."""
    if text.isascii():
        return text.encode("ascii").lower().translate(_NOT_WORD).split()
    return words(text)


def word_hash(word: str | bytes) -> int:
    data = word if isinstance(word, bytes) else word.encode("utf-8", errors="surrogatepass")  # lone surrogates
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class WordHashes(dict):
    """word -> hash, computed once per distinct word."""

    def __missing__(self, word: str | bytes) -> int:
        if len(self) >= _CACHE_WORDS:
            self.clear()
        h = self[word] = word_hash(word)
        return h

    def array(self, ws: list) -> np.ndarray:
        return np.fromiter(map(self.__getitem__, ws), np.uint64, count=len(ws))


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def ngram_hashes(hashes: np.ndarray, docs: np.ndarray, lengths) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{k: (hash of each k-word window inside one document, its start)} for each k in `lengths`.

    `hashes` are word hashes (uint64) of a chunk, `docs` the document index of each word
    (non-decreasing). The k-word hashes are built from the (k-1)-word ones, so all the lengths
    cost max(lengths) passes together.
    """
    want, out = set(lengths), {}
    acc = hashes.copy()
    for k in range(1, max(want, default=0) + 1):
        if k > 1:
            acc = acc[:-1] * _MULT + hashes[k - 1 :]
        if k in want:
            starts = np.flatnonzero(docs[: len(acc)] == docs[k - 1 :])  # first and last word in one doc
            out[k] = (_mix(acc[starts]), starts)
    return out


class Lookup:
    """Sets of n-gram hashes, one per length k. A bitmap on the low bits of all of them rejects
    most absent values with one gather; the few others are binary-searched in the sorted set."""

    def __init__(self, by_length: dict[int, np.ndarray]):
        self.sets = {k: np.unique(h) for k, h in by_length.items()}
        total = sum(len(h) for h in self.sets.values())
        bits = int(np.clip(np.ceil(np.log2(max(total, 1) * 32)), 16, 25))  # <= 32 MB; ~3% false hits
        self.mask = np.uint64((1 << bits) - 1)
        self.bitmap = np.zeros(1 << bits, bool)
        for h in self.sets.values():
            self.bitmap[h & self.mask] = True

    def hits(self, k: int, values: np.ndarray) -> np.ndarray:
        """The values that are in set k (with repeats)."""
        maybe, targets = values[self.bitmap[values & self.mask]], self.sets[k]
        if len(targets) == 0:
            return maybe[:0]
        at = np.minimum(np.searchsorted(targets, maybe), len(targets) - 1)
        return maybe[targets[at] == maybe]
