"""The radix prefix cache against a plain dict model (hypothesis state machine), plus the unit-level rules.

Model: `cached[prefix] = page` for every cached whole page, keyed by the full key up to the end of that page.
Requests match, lock, take private pages for the rest of their key, then either insert (finish) or free
(abort); eviction and flush run in between. After every step: no page is owned twice (tree, requests, free
list), locked pages are still cached with the pages their requests hold, and the allocator's count equals the
tree's pages plus the requests' private pages, so every page went back exactly once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from treepage.mem_cache.allocator import PagedAllocator
from treepage.mem_cache.radix_cache import RadixCache, TreeNode, cache_key

NUM_PAGES = 40


class _Req:
    def __init__(self, key: tuple[int, ...], shared: list[int], own: list[int], node: TreeNode) -> None:
        self.key, self.shared, self.own, self.node = key, shared, own, node


class RadixMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.P = 0
        self.cached: dict[tuple[int, ...], int] = {}
        self.live: list[_Req] = []

    @initialize(page=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page: int, policy: str) -> None:
        self.P = page
        self.alloc = PagedAllocator(NUM_PAGES, page)
        self.cache = RadixCache(self.alloc, page, policy)

    def _expected_match(self, key: tuple[int, ...]) -> list[int]:
        pages, k = [], 1
        while k * self.P <= len(key) and key[: k * self.P] in self.cached:
            pages.append(self.cached[key[: k * self.P]])
            k += 1
        return pages

    @rule(target=reqs, units=st.lists(st.integers(0, 2), min_size=0, max_size=14))
    def admit(self, units: list[int]) -> _Req | None:
        key = tuple(units[: len(units) // self.P * self.P])
        m = self.cache.match_prefix(key)
        assert m.pages == self._expected_match(key)
        self.cache.lock(m.node)
        n_own = len(key) // self.P - len(m.pages)
        got = self.alloc.alloc_pages(n_own)
        if got is None:
            self.cache.evict(n_own - self.alloc.num_free_pages())
            self._resync()
            got = self.alloc.alloc_pages(n_own)
        if got is None:
            self.cache.unlock(m.node)
            return None
        r = _Req(key, m.pages, got.tolist(), m.node)
        self.live.append(r)
        return r

    @rule(r=consumes(reqs))
    def finish(self, r: _Req | None) -> None:
        if r is None:
            return
        self.cache.insert(list(r.key), r.shared + r.own)
        for k in range(1, len(r.key) // self.P + 1):
            self.cached.setdefault(r.key[: k * self.P], (r.shared + r.own)[k - 1])
        self.cache.unlock(r.node)
        self.live.remove(r)

    @rule(r=consumes(reqs))
    def abort_without_caching(self, r: _Req | None) -> None:
        if r is None:
            return
        if r.own:
            self.alloc.free_pages(torch.tensor(r.own))
        self.cache.unlock(r.node)
        self.live.remove(r)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        before = dict(self.cached)
        evictable = self.cache.evictable_pages()
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable)
        self._resync()
        gone = set(before) - set(self.cached)
        assert not set(self.cached) - set(before)
        assert sum(1 for _ in gone) == freed
        for r in self.live:  # locked pages stay
            for k in range(1, len(r.shared) + 1):
                assert self.cached[r.key[: k * self.P]] == r.shared[k - 1]

    @precondition(lambda self: not self.live)
    @rule()
    def flush(self) -> None:
        self.cache.flush()
        self.cached.clear()
        assert self.alloc.num_free_pages() == NUM_PAGES

    def _resync(self) -> None:
        """Read the tree's content into the model form (after eviction, whose victims the model cannot pick)."""
        out: dict[tuple[int, ...], int] = {}
        stack = [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                p = prefix
                for i, page in enumerate(child.pages):
                    p = p + tuple(child.key[i * self.P : (i + 1) * self.P])
                    out[p] = page
                stack.append((child, p))
        # prefix-closed: every cached page's shorter prefixes are cached too
        assert all(k[: j * self.P] in out for k in out for j in range(1, len(k) // self.P))
        self.cached = out

    @invariant()
    def consistent(self) -> None:
        self.cache.check([r.node for r in self.live])
        tree_pages = self.cache.all_pages()
        assert sorted(tree_pages) == sorted(self.cached.values())
        own = [p for r in self.live for p in r.own]
        everything = tree_pages + own + list(self.alloc._free)
        assert len(everything) == len(set(everything)) == NUM_PAGES, "a page is owned twice or lost"
        assert self.alloc.num_used_pages() == len(tree_pages) + len(own)
        locked = {id(n) for r in self.live for n in _path(r.node, self.cache.root)}
        assert self.cache.locked_pages == sum(len(n.pages) for n in self.cache._nodes() if id(n) in locked)


def _path(node: TreeNode, root: TreeNode) -> list[TreeNode]:
    out = []
    while node is not root:
        out.append(node)
        node = node.parent  # type: ignore[assignment]
    return out


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_pair_keys_distinguish_the_successor() -> None:
    """Same tokens, different next token: different pages under pair keys, the same under plain keys."""
    alloc = PagedAllocator(16, 2)
    cache = RadixCache(alloc, 2, pair_keys=True)
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 1, 9]
    n = cache.cacheable_len(a, committed=5)
    assert n == 4  # the last token has no successor yet
    cache.insert(cache.key_of(a)[:n], alloc.alloc_pages(2).tolist())
    assert len(cache.match_prefix(cache.key_of(a)).pages) == 2
    # b shares tokens 5 6 7 but position 2's successor differs: only the first page (pairs (5,6) (6,7)) is valid
    assert len(cache.match_prefix(cache.key_of(b)).pages) == 1
    assert cache_key([1, 2, 3], pair_keys=False) == [1, 2, 3]


def test_lru_and_lfu_pick_different_victims() -> None:
    for policy, survivor in (("lru", [2, 2]), ("lfu", [1, 1])):
        alloc = PagedAllocator(8, 2)
        cache = RadixCache(alloc, 2, policy)
        cache.insert([1, 1], alloc.alloc_pages(1).tolist())
        cache.insert([2, 2], alloc.alloc_pages(1).tolist())
        for _ in range(3):
            cache.match_prefix([1, 1])  # hit often, but long ago
        cache.match_prefix([2, 2])  # the most recent access
        assert cache.evict(1) == 1
        assert cache.match_prefix(survivor).pages, policy


def test_disabled_cache_frees_what_it_is_given() -> None:
    alloc = PagedAllocator(4, 1)
    cache = RadixCache(alloc, 1, disabled=True)
    cache.insert([1, 2], alloc.alloc_pages(2).tolist())
    assert alloc.num_used_pages() == 0 and cache.num_pages == 0
    assert cache.match_prefix([1, 2]).pages == []


def test_insert_frees_duplicates_keeps_shared() -> None:
    alloc = PagedAllocator(8, 1)
    cache = RadixCache(alloc, 1)
    first = alloc.alloc_pages(3).tolist()
    cache.insert([1, 2, 3], first)
    m = cache.match_prefix([1, 2, 9])
    cache.lock(m.node)
    other = alloc.alloc_pages(
        2
    ).tolist()  # a concurrent request's private copy of [1, 2, 3, 4] beyond its hit
    cache.insert([1, 2, 3, 4], m.pages + other)
    assert cache.match_prefix([1, 2, 3, 4]).pages == first + [other[1]]
    assert alloc.num_used_pages() == 4  # other[0] duplicated page 3 and went back
    cache.unlock(m.node)
    cache.check()
    with pytest.raises(RuntimeError):
        cache.lock(m.node)
        cache.flush()
