"""Host-side bookkeeping of the page pool: which pages are free, which requests hold each page."""

from __future__ import annotations

import collections


class PageAllocator:
    """Hands out pages 1..pages-1 (page 0 is never handed out: unused page-table entries point at
    it). A request takes, when it is admitted, every page it can need (prompt + max new tokens), so a
    running request never waits for memory and nothing is ever preempted; it gives them all back
    when it finishes, early or not.

    A request may also take `shared` pages: a cached prefix (lm.infer.engine.prefix) that it reads
    and never writes. A page is counted once per request holding it and is free only when none
    does. Free pages go out oldest-returned first, and a request gives its pages back last page
    first, so a cached prefix is overwritten as late as possible (least recently used) and from
    its end (a chain is found from its start).

    slot_width > 0: the slot-major layout, for a pool that holds every slot's whole context: slot s
    owns pages s*slot_width .. (s+1)*slot_width - 1, so a slot's pages are always free and
    consecutive, and a decode call over all slots reads the pool in place (lm.model.paged). Nothing
    is shared there (a slot's pages are its own): a cached prefix is copied instead."""

    def __init__(self, pages: int, page_size: int, slot_width: int = 0):
        self.page_size, self.slot_width = page_size, slot_width
        self.total = slot_width or pages - 1  # the most one request can hold
        self.capacity = pages if slot_width else pages - 1  # pages requests can hold together
        self._free = collections.OrderedDict.fromkeys(() if slot_width else range(1, pages))
        self._holders: collections.Counter = collections.Counter()  # page -> requests holding it
        self._slot_pages = 0  # slot-major: pages held

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        return self.capacity - self._slot_pages if self.slot_width else len(self._free)

    def holders(self, page: int) -> int:
        return self._holders[page]

    def take(self, tokens: int, slot: int = 0, shared=()) -> list[int] | None:
        """Pages for `tokens` positions (for `slot`), the first ones `shared`; None if too few are free now."""
        n = self.pages_for(tokens)
        if self.slot_width:
            assert not shared, "the slot-major layout shares no page"
            self._slot_pages += n
            return list(range(slot * self.slot_width, slot * self.slot_width + n))
        fresh = n - len(shared)
        if fresh > len(self._free) - sum(page in self._free for page in shared):
            return None
        for page in shared:
            self._free.pop(page, None)
        taken = list(shared) + [self._free.popitem(last=False)[0] for _ in range(fresh)]
        self._holders.update(taken)
        return taken

    def give_back(self, pages: list[int]) -> None:
        if self.slot_width:
            self._slot_pages -= len(pages)
            return
        for page in reversed(pages):
            self._holders[page] -= 1
            if not self._holders[page]:
                del self._holders[page]
                self._free[page] = None
