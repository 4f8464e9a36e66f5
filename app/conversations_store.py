"""The conversations of OpenAI's Conversations API (`/v1/conversations`): bounded, in memory, least recently used out
first, as the stored responses are (`responses_api_store.LruStore`, by the same `--responses-store-size` and
`--responses-store-bytes`, counted apart).

Each entry holds a conversation's creation time, its metadata and its items, each as the JSON text of a stored input
item (`responses_api_convert.stored_items`' shape), in order, by id. An entry is never changed: adding or deleting an
item stores a new entry in its place, so that a conversation that would no longer fit the byte bound is refused
whole, the stored one kept. Only the event loop touches the store, so a change (read, then put, with no await
between) is atomic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property

from sluice.app.responses_api_store import LruStore


@dataclass(frozen=True)
class StoredConversation:
    """`items`: each item's id -> its JSON, in the conversation's order."""

    created_at: int
    metadata: dict[str, str]
    items: dict[str, str] = field(default_factory=dict)

    @cached_property
    def size(self) -> int:
        return len(json.dumps(self.metadata).encode()) + sum(len(text.encode()) for text in self.items.values())

    def with_items(self, items: dict[str, str]) -> StoredConversation:
        """This conversation with `items` (ids it does not hold) added after its own."""
        return replace(self, items={**self.items, **items})

    def without_item(self, item_id: str) -> StoredConversation:
        return replace(self, items={key: text for key, text in self.items.items() if key != item_id})


class ConversationStore(LruStore[StoredConversation]):
    """At most `max_count` conversations and `max_bytes` bytes of their items' and metadata's JSON."""
