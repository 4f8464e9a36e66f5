"""The KV page pool: allocation with reference counts and automatic prefix caching.

A full page is cached under its key (the previous page's hash, its token ids), the hash chained from page to page, so
equal prefixes map to equal keys whatever request they came from (a request's `cache_salt` or LoRA adapter starts its
chain elsewhere: `SamplingParams.cache_namespace`), and only equal prefixes: the hash, blake2b, is one no client can
make collide. A page whose last reference goes away stays cached, reusable until it is evicted, least recently freed
first, to make room for new allocations.

With a persistent prefix store (`kv_store.py`, host RAM then disk), the cache has a tier below the pool: every
page newly full is listed in `saves` for the engine to copy out to the store, and a prefix found in the store
past what the pool holds is admitted into fresh pages, listed in `loads` for the engine to write into the pool
before the step that reads them. The store reads those pages on its own thread, asked when the sequence starts
waiting (`prefetch`); until they are in, `match_prefix` says to try again later.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from sluice.batching.kv_store import KVStore, PageKey, PagePayload, StoredPrefix
from sluice.batching.sequence import Sequence

_ROOT_HASH = 0
_HASH_BYTES = 16

CacheKey = tuple[int, tuple[int, ...]]
"""A full page's key in the prefix cache: (the hash of the previous page's key, or `root_hash`; its token ids)."""


def _digest(data: bytes, person: bytes) -> int:
    """blake2b of `data`, as an int: not Python's `hash`, whose 64 bits a client inverts to craft a prefix that
    collides with another's, and then be served pages computed after its own."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=_HASH_BYTES, person=person).digest(), "little")


def root_hash(seq: Sequence) -> int:
    """The parent of `seq`'s first page: requests share cached pages only in the same `cache_namespace`."""
    namespace = seq.params.cache_namespace
    return _ROOT_HASH if namespace is None else _digest(json.dumps(list(namespace)).encode(), b"namespace")


def _page_hash(parent: int, tokens: list[int]) -> int:
    """The hash of a full page's key: `parent` and its token ids."""
    return _digest(parent.to_bytes(_HASH_BYTES, "little") + array("q", tokens).tobytes(), b"page")


@dataclass(frozen=True)
class PoolCounters:
    pages_total: int
    pages_used: int
    pages_cached: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


class BlockManager:
    """Owns `num_pages` pages of `page_size` token slots; sequences hold pages through their `page_table`.

    A page table only grows in place; any other change gives the sequence a new list (the runner's persistent
    input batch keeps a row current by appending what a list it already holds has gained)."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 store: KVStore | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.store = store if enable_prefix_caching else None
        self.hit_tokens = 0
        self.query_tokens = 0
        self.reset()

    def reset(self) -> None:
        """Forgets every allocation and cached page (the pool's contents are gone); the counters go on."""
        num_pages = self.num_pages
        self.ref_counts = [0] * num_pages
        self._page_key: list[CacheKey | None] = [None] * num_pages  # a cached page's key
        self._cached: dict[CacheKey, int] = {}  # key -> page
        self._free: deque[int] = deque(range(num_pages))  # unreferenced, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; oldest first
        self.loads: list[tuple[int, PagePayload]] = []  # (page, what to write into it), for the engine
        self.saves: list[tuple[int, PageKey]] = []  # (page, its store key), for the engine to copy out

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (never-used ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def counters(self) -> PoolCounters:
        return PoolCounters(pages_total=self.num_pages, pages_used=self.num_used_pages, pages_cached=len(self._cached),
                            prefix_cache_hit_tokens=self.hit_tokens, prefix_cache_query_tokens=self.query_tokens)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[PagePayload] | None]:
        """(pages, stored): cached pages holding a prefix of `seq`'s tokens, then the payloads of the store's pages
        that continue it, None while the store is still reading them; takes nothing.

        At least the last token is left to compute, since its logits are needed to sample; a sequence that
        `computes_every_token` takes none.
        """
        pages = self._cached_prefix(seq)
        return pages, self._stored(seq, len(pages))

    def prefetch(self, seq: Sequence) -> None:
        """Asks the store for `seq`'s pages past those the pool holds now, if it has the first of them: `seq` has
        started waiting, and its admission will want them."""
        if self.store is not None:
            self.match_prefix(seq)

    def _keys(self, seq: Sequence, first: int, end: int) -> Iterator[CacheKey]:
        """The keys of `seq`'s full pages `first` to `end - 1`, whose tokens must be known. Its chain of (key, hash)
        is kept on it as it is made (`seq.page_chain`: a known prefix's keys never change), so a sequence waiting for
        room hashes its prefix once, not at each try to admit it."""
        chain = seq.page_chain
        yield from (key for key, _ in chain[first:end])
        for i in range(len(chain), end):
            parent = chain[-1][1] if chain else root_hash(seq)
            tokens = seq.token_ids[i * self.page_size:(i + 1) * self.page_size]
            chain.append(((parent, tuple(tokens)), _page_hash(parent, tokens)))
            if i >= first:
                yield chain[-1][0]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The pool's cached pages holding a prefix of `seq`'s known tokens (all but its last)."""
        pages: list[int] = []
        if not self.enable_prefix_caching or seq.computes_every_token:
            return pages
        for key in self._keys(seq, 0, min(seq.num_tokens - 1, seq.num_known_tokens) // self.page_size):
            if (page := self._cached.get(key)) is None:
                break
            pages.append(page)
        return pages

    def _stored(self, seq: Sequence, start: int) -> list[PagePayload] | None:
        """The store's payloads of `seq`'s pages from `start` on, as far as it holds them, before its last token's
        page and the first page with a token still on the device (a placeholder has no key); None while they are
        being read. The first ask starts the read (unless the store lacks the first page), as does one that finds
        the pool has lost pages since its read began, or that wants pages known since."""
        end = min(seq.num_tokens - 1, seq.num_known_tokens) // self.page_size
        if self.store is None or seq.computes_every_token or start >= end:
            return []
        read = seq.stored_prefix
        if read is None or read.first > start or read.end < end:
            keys = self._store_keys(seq, end)[start:end]
            if not self.store.contains(keys[0]):
                return []
            read = seq.stored_prefix = StoredPrefix(start, end, self.store.prefetch(keys))
        if not read.payloads.done():
            return None
        return read.payloads.result()[start - read.first:end - read.first]

    def _store_keys(self, seq: Sequence, num_pages: int) -> list[PageKey]:
        """The store keys of `seq`'s first `num_pages` full pages, whose tokens must be known (kept on it: a prefix's
        keys never change)."""
        known = len(seq.store_keys)
        if known < num_pages:
            parent = seq.store_keys[-1] if known else None
            tokens = seq.token_ids[known * self.page_size:num_pages * self.page_size]
            seq.store_keys += self.store.layout.page_keys(tokens, parent, seq.params.cache_namespace)
        return seq.store_keys

    def can_admit(self, seq: Sequence, shared: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` (holding no pages) can take `shared` pages and room for `num_new_tokens` after them (the
        stored pages it loads included)."""
        reclaimed = sum(1 for p in shared if self.ref_counts[p] == 0)
        fresh = self.pages_needed(len(shared) * self.page_size + num_new_tokens) - len(shared)
        return fresh + reclaimed <= self.num_free_pages

    def admit(self, seq: Sequence, shared: list[int], stored: list[PagePayload] = (), *, count_query: bool) -> None:
        """Gives `seq` (holding no pages) the full pages in `shared` (in the prefix cache, when caching: a cached
        prefix's, or the prompt's its request's first sequence computed), then fresh pages for the `stored` payloads
        after them (listed in `loads`). Their tokens count as computed."""
        for page in shared:
            self._take(page)
        seq.page_table = list(shared)
        seq.num_committed_pages = len(shared) if self.enable_prefix_caching else 0
        for payload in stored:
            seq.page_table.append(self._allocate())
            self.loads.append((seq.page_table[-1], payload))
        seq.num_computed_tokens = len(seq.page_table) * self.page_size
        seq.num_stored_pages = max(seq.num_stored_pages, len(seq.page_table))
        seq.stored_prefix = None
        if count_query and self.enable_prefix_caching:  # without a cache, a sibling's shared pages are no hit
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens
        if stored:
            self.commit(seq)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(seq.page_table) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Adds pages so `seq.page_table` has slots for its first `num_tokens` tokens."""
        for _ in range(self.pages_needed(num_tokens) - len(seq.page_table)):
            seq.page_table.append(self._allocate())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Returns the pages of `seq` past those its first `num_tokens` tokens need (never cached ones: only
        pages past every computed token)."""
        keep = self.pages_needed(num_tokens)
        for page in reversed(seq.page_table[keep:]):
            self._release(page)
        seq.page_table = seq.page_table[:keep]

    def commit(self, seq: Sequence) -> None:
        """Registers the pages `seq` has completely computed, and whose tokens are known, in the prefix cache (and
        lists those the store lacks in `saves`)."""
        if not self.enable_prefix_caching or (seq.num_committed_pages + 1) * self.page_size > seq.num_computed_tokens:
            return  # no page newly full (most steps)
        first = seq.num_committed_pages
        end = min(seq.num_computed_tokens, seq.num_known_tokens) // self.page_size
        for page, key in zip(seq.page_table[first:end], self._keys(seq, first, end), strict=True):
            if key not in self._cached and self._page_key[page] is None:
                self._cached[key] = page
                self._page_key[page] = key
        seq.num_committed_pages = max(first, end)
        if self.store is not None:  # asked each time: it may have evicted what a readmitted sequence saved before
            keys = self._store_keys(seq, end)
            self.saves += [(seq.page_table[i], keys[i]) for i in range(first, end) if not self.store.contains(keys[i])]
            seq.num_stored_pages = max(seq.num_stored_pages, end)

    def uncache(self, seq: Sequence) -> None:
        """Takes the cached pages of `seq`'s known tokens out of the prefix cache (their K/V is suspect); they are
        freed, not kept, once nobody holds them. Found by its tokens, not its page table: overlapped, a sequence
        preempted after its step was dispatched has freed its pages (cached still) by the time its logits come."""
        for key in self._keys(seq, 0, seq.num_known_tokens // self.page_size):
            page = self._cached.pop(key, None)
            if page is not None:
                self._page_key[page] = None
                if self.ref_counts[page] == 0:
                    del self._evictable[page]
                    self._free.append(page)

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references; pages nobody references become free (or evictable when cached)."""
        for page in reversed(seq.page_table):  # the tail first, so a prefix outlives its extensions in the LRU
            self._release(page)
        seq.page_table = []
        seq.num_committed_pages = 0
        seq.num_computed_tokens = 0

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if self._page_key[page] is None:
                self._free.append(page)
            else:
                self._evictable[page] = None

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self._evictable[page]
        self.ref_counts[page] += 1

    def _allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._cached[self._page_key[page]]
            self._page_key[page] = None
        else:
            raise RuntimeError("KV page pool exhausted")
        self.ref_counts[page] = 1
        return page
