"""Request rows (position -> KV slot) and the per-model KV pools, plus the row helpers that keep them in step.

One allocator and one ReqToTokenPool serve both the target and the draft KVPool: a slot names the same token
position in both pools.
"""

from __future__ import annotations

import torch

from treepage.mem_cache.allocator import MemoryLeakError, PagedAllocator


class ReqToTokenPool:
    """`req_to_token[row, i]` is the KV slot of position i of the request that owns the row."""

    def __init__(self, size: int, row_width: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.row_width = row_width
        self.req_to_token = torch.zeros(size, row_width, dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._in_use = bytearray(size)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._in_use[row] = 1
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} out of range 0..{self.size - 1}")
        if not self._in_use[row]:
            raise ValueError(f"double free of row {row}")
        self._in_use[row] = 0
        self._free.append(row)

    def num_free(self) -> int:
        return len(self._free)

    def check_leak(self, expected_used: int = 0, full: bool = True) -> None:
        """Rows in use must equal expected_used (O(1)); full=True also recounts the in-use flags."""
        in_use = self.size - len(self._free)
        if full and sum(self._in_use) != in_use:
            raise MemoryLeakError(f"row accounting broken: free={len(self._free)} in_use={sum(self._in_use)}")
        if in_use != expected_used:
            raise MemoryLeakError(f"{in_use} rows in use, expected {expected_used}")


class KVPool:
    """K and V of every layer in ONE buffer [2, layers, slots, heads, dim], so one launch can reach all layers."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_data = torch.zeros(
            2, num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    @property
    def device(self) -> torch.device:
        return self.kv_data.device

    @property
    def num_slots(self) -> int:
        return self.kv_data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.kv_data.numel() * self.kv_data.element_size()

    def free(self) -> None:
        """Give the buffer back now that no forward will run. An engine sits in reference cycles (its threads and
        callbacks), so without this its KV (a gigabyte by default on CPU) waits for a full garbage collection."""
        self.kv_data = self.kv_data[:, :, :0].clone()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_data[0, layer_id].index_copy_(0, slots, k.to(self.dtype))
        self.kv_data[1, layer_id].index_copy_(0, slots, v.to(self.dtype))

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_data[0, layer_id], self.kv_data[1, layer_id]

    def move_kv_cache(self, dst_slots: torch.Tensor, src_slots: torch.Tensor) -> None:
        """Copy K and V of every layer; all sources are read before any destination is written."""
        planes = self.kv_data.view(2 * self.num_layers, self.num_slots, -1)  # contiguous slot vectors
        planes.index_copy_(1, dst_slots, planes.index_select(1, src_slots))


def build_page_table(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    max_len: int | None = None,
) -> torch.Tensor:
    """[B, ceil(max_len / P)] page ids of positions [0, kv_lens[b]); pages past the length are 0 (padding).

    Relies on slot % P == pos % P, so the first slot of each page names the page. At P == 1 it is the slot list.
    """
    if max_len is None:
        max_len = int(kv_lens.max().item()) if kv_lens.numel() else 0
    num_cols = (max_len + page_size - 1) // page_size
    starts = torch.arange(num_cols, device=req_to_token.device, dtype=torch.int64) * page_size
    valid = starts[None, :] < kv_lens[:, None]
    cols = torch.where(valid, starts[None, :], 0)
    pages = req_to_token[rows[:, None], cols] // page_size
    return torch.where(valid, pages, 0)


def write_row_slots(req_to_token: torch.Tensor, row: int, start: int, slots: torch.Tensor) -> None:
    """Write through the flat index row * width + start + j, as a GPU kernel would.

    Deliberately unchecked: past the row end the write spills into the next row. That is the failure the
    row-width invariant (sizing.check_row_width) exists to prevent.
    """
    n = slots.numel()
    if n == 0:
        return
    base = row * req_to_token.shape[1] + start
    req_to_token.view(-1)[base : base + n] = slots.to(req_to_token.dtype)


def write_row_pages(req_to_token: torch.Tensor, row: int, pages: list[int], page_size: int) -> None:
    """Point row positions [0, len(pages) * P) at whole pages, in order (a prefix-cache hit)."""
    if not pages:
        return
    offs = torch.arange(page_size, dtype=torch.int64, device=req_to_token.device)
    first = torch.tensor(pages, dtype=torch.int64, device=req_to_token.device) * page_size
    write_row_slots(req_to_token, row, 0, (first[:, None] + offs).reshape(-1))


def grow_row(
    req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, row: int, cur_len: int, new_len: int
) -> bool:
    """Give positions [cur_len, new_len) slots, filling the partial last page first; False (no change) if out of pages."""
    if new_len <= cur_len:
        return True
    P = allocator.page_size
    r2t = req_to_token_pool.req_to_token
    page_end = (cur_len + P - 1) // P * P  # end of the partially filled last page
    n_pages = (new_len - page_end + P - 1) // P if new_len > page_end else 0
    pages = allocator.alloc_pages(n_pages)
    if pages is None:
        return False
    parts = []
    n_partial = min(new_len, page_end) - cur_len
    if n_partial > 0:
        # Same physical page as position cur_len - 1; read via the flat index, like the write.
        last = r2t.view(-1)[row * r2t.shape[1] + cur_len - 1]
        first = last - (cur_len - 1) % P + cur_len % P
        parts.append(first + torch.arange(n_partial, dtype=torch.int64, device=r2t.device))
    if n_pages:
        offs = torch.arange(P, dtype=torch.int64, device=r2t.device)
        parts.append((pages[:, None] * P + offs).reshape(-1)[: new_len - page_end])
    write_row_slots(r2t, row, cur_len, torch.cat(parts))
    return True


def free_row(
    req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator, row: int, start: int, end: int
) -> None:
    """Free the pages of positions [start, end), start page-aligned.

    Reads the slice req_to_token[row, start:end], which silently clamps at the row end: slots an overflowing
    write put past the row are never returned (a leak check then catches them).
    """
    P = allocator.page_size
    if start % P:
        raise ValueError(f"free_row start {start} is not page-aligned (P={P})")
    if end <= start:
        return
    first_slots = req_to_token_pool.req_to_token[row, start:end:P]
    allocator.free_pages(first_slots // P)
