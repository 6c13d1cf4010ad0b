"""Host-side bookkeeping of the page pool: which pages are free, which a request holds."""

from __future__ import annotations

import collections


class PageAllocator:
    """Hands out pages 1..pages-1 (page 0 is never handed out: unused page-table entries point at
    it). A request takes, when it is admitted, every page it can need (prompt + max new tokens), so a
    running request never waits for memory and nothing is ever preempted; it gives them all back
    when it finishes, early or not. Free pages go out oldest-returned first, so a page that holds a
    cached prefix (lm.infer.engine.prefix) is overwritten as late as possible (least recently used).

    slot_width > 0: the slot-major layout, for a pool that holds every slot's whole context: slot s
    owns pages s*slot_width .. (s+1)*slot_width - 1, so a slot's pages are always free and
    consecutive, and a decode call over all slots reads the pool in place (lm.model.paged)."""

    def __init__(self, pages: int, page_size: int, slot_width: int = 0):
        self.page_size, self.slot_width = page_size, slot_width
        self.total = slot_width or pages - 1  # the most one request can hold
        self.capacity = pages if slot_width else pages - 1  # pages requests can hold together
        self._free = collections.OrderedDict.fromkeys(() if slot_width else range(1, pages))
        self._held = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        return self.capacity - self._held

    def take(self, tokens: int, slot: int = 0) -> list[int] | None:
        """Pages for `tokens` positions (for `slot`), or None if too few are free now."""
        n = self.pages_for(tokens)
        if self.slot_width:
            taken = list(range(slot * self.slot_width, slot * self.slot_width + n))
        elif n > len(self._free):
            return None
        else:
            taken = [self._free.popitem(last=False)[0] for _ in range(n)]
        self._held += n
        return taken

    def give_back(self, pages: list[int]) -> None:
        self._held -= len(pages)
        if not self.slot_width:
            self._free.update(dict.fromkeys(pages))

    def touch(self, pages) -> None:
        """Pages just read (a cached prefix): of the free ones, handed out last."""
        for page in pages:
            if page in self._free:
                self._free.move_to_end(page)
