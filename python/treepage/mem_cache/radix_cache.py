"""Radix prefix cache over whole KV pages (docs/design.md, "Prefix cache").

The tree is keyed by whole pages of *units*: token ids without speculation, (token, next token) pairs with it,
because the draft model's KV at position p is computed from token p + 1. Each node holds the page ids of its
key, one page per P units. Only whole pages enter the tree, so a hit is page-aligned, never needs copy-on-write,
and a request never writes into a shared page.

Ownership: a page is held either privately by one request's row or by the tree, never both. `insert` takes
ownership of every page it is handed: a page the tree already holds at that place is kept, a duplicate is
freed at once, a new one is adopted. A request in flight locks the path it matched (reference counts up to the
root), so those pages are never evicted under it; eviction frees unlocked leaves, least recently used first
(`lru`) or least often hit first (`lfu`).

Disabled (`--disable-radix-cache`), the tree caches nothing, but it still shares the prompt pages of a sample
group (n > 1, docs/design.md "Parallel sampling"): `shared=True` inserts and matches work, and a node is freed as
soon as no request locks it, so the tree holds only pages some request in flight reads.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from treepage.mem_cache.allocator import MemoryLeakError, PagedAllocator

EVICTION_POLICIES = ("lru", "lfu")


def cache_key(ids: Sequence[int], pair_keys: bool) -> list[Hashable]:
    """The units of a token sequence: the ids, or (id, next id) pairs (one unit fewer than tokens)."""
    if pair_keys:
        return list(zip(ids, ids[1:]))
    return list(ids)


@dataclass(eq=False)
class TreeNode:
    key: list[Hashable]  # units, a whole number of pages
    pages: list[int]  # one page id per page of key
    parent: TreeNode | None
    children: dict[tuple[Hashable, ...], TreeNode] = field(default_factory=dict)  # by first page of key
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0

    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    pages: list[int]  # page ids of the matched prefix, in order
    node: TreeNode  # the deepest matched node: lock / unlock it

    def num_units(self, page_size: int) -> int:
        return len(self.pages) * page_size


class RadixCache:
    def __init__(
        self,
        allocator: PagedAllocator,
        page_size: int,
        policy: str = "lru",
        disabled: bool = False,
        pair_keys: bool = False,
    ) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"--radix-eviction-policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}"
            )
        self.allocator = allocator
        self.P = page_size
        self.policy = policy
        self.disabled = disabled
        self.pair_keys = pair_keys  # with speculation: the draft KV at p depends on token p + 1
        self._clock = itertools.count(1)
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1  # never evicted
        self.num_pages = 0  # pages the tree holds
        self.locked_pages = 0  # of those, pages on a path some request has locked
        self.evicted_pages = 0  # over the cache's lifetime (statistics)

    # ---- sizes -------------------------------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        return self.num_pages - self.locked_pages

    def key_of(self, ids: Sequence[int]) -> list[Hashable]:
        return cache_key(ids, self.pair_keys)

    def cacheable_len(self, ids: Sequence[int], committed: int) -> int:
        """How many leading tokens of a request may enter the tree: committed KV only, whole pages only, and
        with pair keys only positions whose next token is known (so its draft KV was computed from it)."""
        units = len(ids) - 1 if self.pair_keys else len(ids)
        return min(committed, units) // self.P * self.P

    # ---- match / insert -----------------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[Hashable], shared: bool = False) -> MatchResult:
        """The longest cached prefix of `key` in whole pages. Splits a node matched part-way, so the returned node
        ends exactly at the match (locking it protects exactly those pages). A disabled tree matches only for a
        sample group (`shared`)."""
        if self.disabled and not shared:
            return MatchResult([], self.root)
        P = self.P
        node, pages, i = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while len(key) - i >= P:
            child = node.children.get(tuple(key[i : i + P]))
            if child is None:
                break
            n = self._common_pages(child.key, key, i)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            child.hit_count += 1
            pages += child.pages
            i += n * P
            node = child  # a part-way match was split off, so the next lookup misses and the walk ends
        return MatchResult(pages, node)

    def insert(self, key: Sequence[Hashable], pages: Sequence[int], shared: bool = False) -> int:
        """Cache `key` (len(pages) whole pages) backed by `pages`, taking ownership of every page: the tree keeps
        the pages it already holds there, frees duplicates and adopts the rest. Returns the pages adopted. A
        disabled tree adopts pages only for a sample group (`shared`), and the caller locks them at once."""
        P = self.P
        if len(key) != len(pages) * P:
            raise ValueError(f"insert needs whole pages: {len(key)} units for {len(pages)} pages of {P}")
        if self.disabled and not shared:
            self._free(pages)
            return 0
        node, i, dup = self.root, 0, []
        now = next(self._clock)
        while i < len(key):
            child = node.children.get(tuple(key[i : i + P]))
            if child is None:
                break
            n = self._common_pages(child.key, key, i)
            if n < len(child.pages):
                child = self._split(child, n)
            p0 = i // P
            dup += [mine for mine, kept in zip(pages[p0 : p0 + n], child.pages) if mine != kept]
            child.last_access = now
            i += n * P
            node = child
        self._free(dup)
        if i == len(key):
            return 0
        new = TreeNode(list(key[i:]), list(pages[i // P :]), node, last_access=now)
        node.children[tuple(key[i : i + P])] = new
        self.num_pages += len(new.pages)
        return len(new.pages)

    # ---- locks -------------------------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Release one lock on the path; a disabled tree frees what no request locks any more."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise MemoryLeakError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
            node = node.parent  # type: ignore[assignment]
        if self.disabled and self.evictable_pages():
            self._evict(self.evictable_pages())

    # ---- eviction ------------------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves if there are that many; returns the pages freed."""
        if num_pages <= 0 or self.disabled:
            return 0
        freed = self._evict(num_pages)
        self.evicted_pages += freed
        return freed

    def _evict(self, num_pages: int) -> int:
        heap = [(self._priority(n), id(n), n) for n in self._nodes() if n.is_leaf() and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += self._delete_leaf(node)
            parent = node.parent
            assert parent is not None
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), id(parent), parent))
        return freed

    def flush(self) -> None:
        """Drop the whole tree (only when no request holds a lock: the engine is idle)."""
        if self.locked_pages:
            raise RuntimeError("radix cache: cannot flush while requests hold cached pages")
        self._free([p for n in self._nodes() for p in n.pages])
        self.root.children.clear()
        self.num_pages = 0

    # ---- checks ----------------------------------------------------------------------------------------------
    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def check(self, expected_locks: Sequence[TreeNode] = ()) -> None:
        """Structure: no page held twice, every page in use by the allocator, sizes and lock counts consistent
        with `expected_locks` (the node each resident request locked)."""
        want: dict[int, int] = {}
        for node in expected_locks:
            while node is not self.root:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent  # type: ignore[assignment]
        pages, locked = [], 0
        for n in self._nodes():
            if len(n.key) != len(n.pages) * self.P or not n.pages:
                raise MemoryLeakError(f"radix cache: node with {len(n.key)} units and {len(n.pages)} pages")
            if n.lock_ref != want.get(id(n), 0):
                raise MemoryLeakError(
                    f"radix cache: node lock_ref {n.lock_ref}, expected {want.get(id(n), 0)}"
                )
            locked += len(n.pages) if n.lock_ref else 0
            pages += n.pages
        if len(set(pages)) != len(pages):
            raise MemoryLeakError("radix cache: a page is held twice by the tree")
        if len(pages) != self.num_pages or locked != self.locked_pages:
            raise MemoryLeakError(
                f"radix cache: counted {len(pages)} pages ({locked} locked), recorded {self.num_pages} "
                f"({self.locked_pages} locked)"
            )
        if any(not self.allocator.is_in_use(p) for p in pages):
            raise MemoryLeakError("radix cache: the tree holds a page the allocator considers free")

    # ---- internals ---------------------------------------------------------------------------------------------
    def _common_pages(self, node_key: list[Hashable], key: Sequence[Hashable], start: int) -> int:
        """How many whole pages of node_key equal key[start:]."""
        P = self.P
        n = 0
        while n * P < len(node_key) and start + (n + 1) * P <= len(key):
            a = n * P
            if node_key[a : a + P] != list(key[start + a : start + a + P]):
                break
            n += 1
        return n

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n pages; the new upper node takes the child's place and its lock count. Returns it."""
        P = self.P
        parent = child.parent
        assert parent is not None and 0 < n < len(child.pages)
        upper = TreeNode(
            child.key[: n * P],
            child.pages[:n],
            parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            hit_count=child.hit_count,
        )
        parent.children[tuple(child.key[:P])] = upper
        child.key, child.pages, child.parent = child.key[n * P :], child.pages[n:], upper
        upper.children[tuple(child.key[:P])] = child
        return upper

    def _delete_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        assert parent is not None and node.is_leaf() and node.lock_ref == 0
        del parent.children[tuple(node.key[: self.P])]
        self._free(node.pages)
        self.num_pages -= len(node.pages)
        return len(node.pages)

    def _priority(self, node: TreeNode) -> tuple[int, int]:
        if self.policy == "lfu":
            return (node.hit_count, node.last_access)
        return (node.last_access, 0)

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _free(self, pages: Sequence[int]) -> None:
        if pages:
            self.allocator.free_pages(torch.tensor(list(pages), dtype=torch.int64))
