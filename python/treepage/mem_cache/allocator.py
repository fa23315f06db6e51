"""Page allocator shared by the target and draft KV pools.

Bookkeeping stays on the host (a python free list and a bytearray of in-use flags) because it is touched once
per request per round; only the handed-out page ids travel to the device.
"""

from __future__ import annotations

import torch


class MemoryLeakError(RuntimeError):
    """Free + in-use pages do not add up, or pages are still held at an idle point."""


class PagedAllocator:
    """Hands out whole pages; physical page 0 is reserved as the padding page.

    Slots [0, P) absorb dummy writes of padded tokens and page tables pad with 0, so page 0 is never handed out.
    Usable pages are 1..num_pages, hence num_slots = (num_pages + 1) * page_size.
    """

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu") -> None:
        if page_size < 1 or page_size > 1024 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two in 1..1024, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = (num_pages + 1) * page_size
        self.device = torch.device(device)
        # LIFO free list, laid out so the first allocations get pages 1, 2, 3, ... (easy to read in dumps).
        self._free: list[int] = list(range(num_pages, 0, -1))
        self._in_use = bytearray(num_pages + 1)

    def num_free_pages(self) -> int:
        return len(self._free)

    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def is_in_use(self, page: int) -> bool:
        return 0 < page <= self.num_pages and bool(self._in_use[page])

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """n page ids (int64), or None when fewer than n are free (then nothing is taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        for p in pages:
            self._in_use[p] = 1
        return torch.tensor(pages, dtype=torch.int64, device=self.device)

    def free_pages(self, pages: torch.Tensor) -> None:
        """Return pages; validates the whole batch first so a bad call changes nothing."""
        ids = pages.reshape(-1).tolist()
        seen: set[int] = set()
        for p in ids:
            if p <= 0 or p > self.num_pages:
                raise ValueError(f"cannot free page {p}: valid pages are 1..{self.num_pages} (0 is padding)")
            if not self._in_use[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in ids:
            self._in_use[p] = 0
        self._free.extend(ids)

    def check_leak(self, expected_used: int = 0, full: bool = True) -> None:
        """Pages in use must equal expected_used: O(1), so the scheduler can run it on every idle tick (a 1M-page
        pool takes ~50 ms to scan). full=True also recounts the in-use flags and looks for duplicate free pages."""
        if full:
            in_use, free = sum(self._in_use), len(self._free)
            dup = free - len(set(self._free))
            if self._in_use[0] or free + in_use != self.num_pages or dup:
                raise MemoryLeakError(
                    f"page accounting broken: free={free} in_use={in_use} total={self.num_pages} "
                    f"(duplicates in free list: {dup})"
                )
        if self.num_used_pages() != expected_used:
            raise MemoryLeakError(f"{self.num_used_pages()} pages in use, expected {expected_used}")
