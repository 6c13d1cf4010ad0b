"""Host-side bookkeeping of the page pool: which pages are free, which a request holds."""

from __future__ import annotations


class PageAllocator:
    """Hands out pages 1..pages-1 (page 0 is never handed out: unused page-table entries point at
    it). A request takes, when it is admitted, every page it can need (prompt + max new tokens), so a
    running request never waits for memory and nothing is ever preempted; it gives them all back
    when it finishes, early or not."""

    def __init__(self, pages: int, page_size: int):
        self.page_size, self.total = page_size, pages - 1
        self._free = list(range(pages - 1, 0, -1))

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, tokens: int) -> list[int] | None:
        """Pages for `tokens` positions, or None if too few are free now."""
        n = self.pages_for(tokens)
        if n > len(self._free):
            return None
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
