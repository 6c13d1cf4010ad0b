"""Prefix caching: the pool's full pages remembered by the tokens that filled them, so a request
whose prompt starts with a cached prefix prefills only the rest (a GRPO group's G samples of one
prompt, a chat's earlier turns, few-shot examples shared by an eval's prompts, a server's system
prompt).

A page's key hashes the key of the page before it and the page's own tokens (a hash chain), so one
key names a whole prefix, never a page's tokens alone. A request takes the longest chain of its
prompt's full pages found here, leaving at least its last prompt token to prefill (the first new
token is chosen from that position's logits).

In a shared pool (`EngineConfig.pages` > 0) the request's page table points at those very pages:
they are read-only (a request writes only positions past its cached prefix), held by every
request that reads them (lm.infer.engine.pages counts holders) and free only when none does; a
free page keeps its key until it is handed out again, least recently used first. In the
slot-major pool (a slot's pages are its own, read in place by the decode steps) the engine copies
them into the request's pages instead, all of a step's admissions in one gather and one scatter.
The engine clears everything when the params change (keys are valid for one set of params).
"""

from __future__ import annotations

import hashlib
import weakref

import jax
import numpy as np


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # page -> key
        self.stats = dict(requests=0, prompt_tokens=0, hit_tokens=0)
        self._params: list = []  # weak references to the leaves of the params the pages were computed with

    def keys(self, tokens, pages: int) -> list[bytes]:
        """The keys of the first `pages` full pages of `tokens`."""
        ps, prev, chain = self.page_size, b"", []
        for i in range(pages):
            page = np.asarray(tokens[i * ps : (i + 1) * ps], np.int64).tobytes()
            prev = hashlib.blake2b(prev + page, digest_size=16).digest()
            chain.append(prev)
        return chain

    def match(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached chain of `keys`, in order."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def count(self, prompt_tokens: int, pages: int) -> None:
        """One admitted request: its prompt's length and the pages it took from the cache."""
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += prompt_tokens
        self.stats["hit_tokens"] += pages * self.page_size

    def forget(self, pages) -> None:
        """Pages about to be overwritten."""
        for page in pages:
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]

    def remember(self, tokens, pages) -> None:
        """`tokens` fill `pages` in order: their full pages become findable (a prefix already
        cached elsewhere keeps its page)."""
        for key, page in zip(self.keys(tokens, len(tokens) // self.page_size), pages):
            if key in self._page_of:
                continue
            self.forget([page])
            self._page_of[key], self._key_of[page] = page, key

    def clear(self) -> None:
        self._page_of.clear()
        self._key_of.clear()

    def belongs_to(self, params) -> None:
        """The cache of a step with `params`: cleared if its pages hold other params' keys and values."""
        if not same_arrays(self._params, params):
            self.clear()
            self._params = array_refs(params)

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens found in the cache (not prefilled)."""
        return self.stats["hit_tokens"] / max(1, self.stats["prompt_tokens"])

    def __len__(self) -> int:
        return len(self._page_of)


class PrefixReuse(PrefixCache):
    """The cache as the engine's admission uses it: which requests start after a cached prefix
    (`lookup`, then `take`), which wait for a prefix a running prefill is writing, and the page
    copies a step owes (`copies`, as padded source and destination pages)."""

    def __init__(self, page_size: int):
        super().__init__(page_size)
        self._copies: list[tuple[int, int]] = []

    def page_keys(self, r) -> list[bytes]:
        """The keys of the full pages of request `r`'s prompt (hashed once per request)."""
        if r.page_keys is None:
            r.page_keys = self.keys(r.prompt, len(r.prompt) // self.page_size)
        return r.page_keys

    def filling(self, prefilling) -> set:
        """The keys of the full prompt pages the requests `prefilling` have yet to write."""
        return {k for r in prefilling for k in self.page_keys(r)}

    def lookup(self, r, filling: set) -> list[int] | None:
        """The pages of the longest cached prefix `r` may take, or None if it should wait: a
        running prefill (`filling`) is writing the next page of that prefix."""
        keys = self.page_keys(r)[: (len(r.prompt) - 1) // self.page_size]
        found = self.match(keys)
        return None if len(found) < len(keys) and keys[len(found)] in filling else found

    def take(self, r, found: list[int], filling: set) -> None:
        """Starts admitted request `r` (its pages given) after the prefix in pages `found`: its
        first pages if shared, else copied into them; its other prompt pages join `filling`."""
        self.count(len(r.prompt), len(found))
        moved = [(src, dst) for src, dst in zip(found, r.pages) if src != dst]  # none if shared or the slot's own
        self.forget([dst for _, dst in moved] + r.pages[len(found) :])  # about to be overwritten
        self._copies += moved
        r.written = len(found) * self.page_size
        filling |= set(self.page_keys(r)[len(found) :])

    def copies(self, pages: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's owed copies (`owed` of them) as (source, destination) pages padded to `width`
        (destination `pages`, past the pool: nowhere), then forgotten."""
        src, dst = np.zeros(width, np.int32), np.full(width, pages, np.int32)
        src[: len(self._copies)], dst[: len(self._copies)] = zip(*self._copies)
        self._copies = []
        return src, dst

    @property
    def owed(self) -> int:
        return len(self._copies)


def array_refs(params) -> list:
    """Weak references to the leaves of `params` (for `same_arrays`; they keep nothing alive)."""
    return [_ref(x) for x in jax.tree.leaves(params)]


def _ref(x):
    try:
        return weakref.ref(x)
    except TypeError:  # a leaf that takes no weak reference (a Python number): held as it is
        return lambda: x


def same_arrays(refs: list, params) -> bool:
    """Whether `params` are the very arrays `refs` (from `array_refs`) point at."""
    leaves = jax.tree.leaves(params)
    return len(refs) == len(leaves) and all(ref() is x for ref, x in zip(refs, leaves))
