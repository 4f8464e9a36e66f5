"""The stored responses of `/v1/responses` (`store: true`): bounded, in memory, least recently used out first.

Each entry holds two JSON texts: the response as `GET /v1/responses/{id}` returns it, and the conversation's
items (the input, an earlier response's included, then the output) that `previous_response_id` continues, of
which the first `input_count` are what `GET /v1/responses/{id}/input_items` lists; and those items' ids, by which
an `item_reference` finds the entry holding one; and, for a background response created with `stream: true`, the
SSE events it sent, which `GET /v1/responses/{id}?stream=true` replays once it has ended (its run holds them while
it runs: `responses_api_background.py`). The bounds count entries and the bytes of those texts and events; storing
past either evicts the least recently used (read or written) first. An entry larger than the byte bound with its
events is stored without them (`events_dropped`); one larger without them is not stored (nor is a response
larger than the bound kept by its earlier entry, a background response's queued one). Only the event loop touches
the store, so it needs no lock. The bounded, least recently used order is `LruStore`'s, which the conversations'
store shares (`conversations_store.py`, whose busy conversations are not evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Generic, Protocol, TypeVar


@dataclass(frozen=True)
class StoredResponse:
    response_json: str
    items_json: str
    input_count: int = 0
    item_ids: frozenset[str] = frozenset()
    events: tuple[bytes, ...] = ()
    events_dropped: bool = False  # it was streamed, but its events alone did not fit the store's byte bound

    @cached_property
    def size(self) -> int:
        return len(self.response_json.encode()) + len(self.items_json.encode()) + sum(map(len, self.events))


class Sized(Protocol):
    @property
    def size(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)


class LruStore(Generic[Entry]):
    """At most `max_count` entries and `max_bytes` bytes of them (their `size`s), by key; storing past either evicts
    the least recently used (read or written) first, of those `_evictable`. An entry larger than `max_bytes` on its
    own is not stored."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, key: str, entry: Entry) -> bool:
        """Stores `entry` in place of the one under `key`, if any, evicting as many of the least recently used others
        as the bounds ask; False, changing nothing, where it cannot fit (also where only entries that are not
        `_evictable` would make room)."""
        if self.max_count < 1 or entry.size > self.max_bytes:
            return False
        victims = self._victims(key, entry.size)
        if victims is None:
            return False
        for victim in victims:
            self._evict(victim)
        self.delete(key)
        self._entries[key] = entry
        self._bytes += entry.size
        return True

    def _victims(self, key: str, size: int) -> list[str] | None:
        """The keys of the least recently used entries (other than `key`, and `_evictable`) whose eviction makes
        room for an entry of `size` bytes under `key`, oldest first; None where evicting all of them would not."""
        held = self._entries.get(key)
        count = len(self._entries) + (held is None)
        total = self._bytes - (0 if held is None else held.size) + size
        victims = []
        for other, entry in self._entries.items():
            if count <= self.max_count and total <= self.max_bytes:
                break
            if other != key and self._evictable(other):
                victims.append(other)
                count -= 1
                total -= entry.size
        return victims if count <= self.max_count and total <= self.max_bytes else None

    def _evictable(self, key: str) -> bool:
        return True

    def _evict(self, key: str) -> None:
        self.delete(key)

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget(key, entry)
        return entry is not None

    def _forget(self, key: str, entry: Entry) -> None:
        """Takes the entry, already out of `_entries`, out of the byte count."""
        self._bytes -= entry.size


class ResponseStore(LruStore[StoredResponse]):
    """The stored responses, and which of them hold each item; a response larger than `max_bytes` with its events is
    stored without them, and one still larger not at all (nor is the entry it replaces kept)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        super().__init__(max_count, max_bytes)
        self._holders: dict[str, set[str]] = {}  # an item's id -> the responses whose conversations hold it

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        self.delete(response_id)
        if entry.size > self.max_bytes and entry.events:
            entry = replace(entry, events=(), events_dropped=True)
        if not super().put(response_id, entry):
            return False
        for item_id in entry.item_ids:
            self._holders.setdefault(item_id, set()).add(response_id)
        return True

    def holding(self, item_id: str) -> StoredResponse | None:
        """A stored response whose conversation holds the item `item_id` (read, as `get` reads it)."""
        holders = self._holders.get(item_id)
        return self.get(next(iter(holders))) if holders else None

    def _forget(self, response_id: str, entry: StoredResponse) -> None:
        super()._forget(response_id, entry)
        for item_id in entry.item_ids:
            holders = self._holders[item_id]
            holders.discard(response_id)
            if not holders:
                del self._holders[item_id]
