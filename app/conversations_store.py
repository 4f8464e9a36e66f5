"""The conversations of OpenAI's Conversations API (`/v1/conversations`): bounded, in memory, least recently used out
first, as the stored responses are (`responses_api_store.LruStore`, by `--conversations-store-size` and
`--conversations-store-bytes`), except those busy: a response running on one (`occupy` to `free`) adds
its turn to it when it ends, so it is not evicted meanwhile. Each eviction is logged.

Each entry holds a conversation's creation time, its metadata and its items, each as the JSON text of a stored input
item (`responses_api_convert.stored_items`' shape), in order, by id; and each item's position, given when it is
stored (the count of items added before it) and kept once it is deleted, so that a listing after a deleted item
goes on from where that item was. An entry is never changed: adding or deleting an item stores a new entry in its
place, so that a conversation that would no longer fit the byte bound is refused whole, the stored one kept. Only
the event loop touches the store, so a change (read, then put, with no await between) is atomic.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from functools import cached_property

from sluice.app.responses_api_store import LruStore

logger = logging.getLogger(__name__)

# What an entry of `items` or `positions` costs beyond its text (the id's, or the item's JSON): a str's header
# (49 bytes), its dict slot and hash, an int: the byte bound counts the memory a conversation holds, not its JSON.
ENTRY_OVERHEAD = 100


@dataclass(frozen=True)
class StoredConversation:
    """`items`: each item's id -> its JSON, in the conversation's order; `positions`: each id it has held -> its
    position; `added`: how many items it has been given; `items_bytes`: what its items and positions cost (`size`)."""

    created_at: int
    metadata: dict[str, str]
    items: dict[str, str] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    added: int = 0
    items_bytes: int = 0

    @cached_property
    def size(self) -> int:
        return len(json.dumps(self.metadata).encode()) + self.items_bytes

    def with_items(self, items: dict[str, str]) -> StoredConversation:
        """This conversation with `items` (ids it does not hold) added after its own."""
        new_ids = [item_id for item_id in items if item_id not in self.positions]
        grown = sum(_text_size(text) for text in items.values()) + sum(_text_size(item_id) for item_id in new_ids)
        positions = {item_id: self.added + index for index, item_id in enumerate(items)}
        return replace(self, items={**self.items, **items}, positions={**self.positions, **positions},
                       added=self.added + len(items), items_bytes=self.items_bytes + grown)

    def without_item(self, item_id: str) -> StoredConversation:
        """This conversation without the item `item_id` (its position kept)."""
        return replace(self, items={key: text for key, text in self.items.items() if key != item_id},
                       items_bytes=self.items_bytes - _text_size(self.items[item_id]))


def _text_size(text: str) -> int:
    return len(text.encode()) + ENTRY_OVERHEAD


class ConversationStore(LruStore[StoredConversation]):
    """At most `max_count` conversations and `max_bytes` bytes of them (`StoredConversation.size`); those `occupy`
    marks busy are not evicted until `free`d."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        super().__init__(max_count, max_bytes)
        self._busy: set[str] = set()

    def occupy(self, conversation_id: str) -> bool:
        """Marks the conversation busy (a response runs on it); False where it is busy already."""
        if conversation_id in self._busy:
            return False
        self._busy.add(conversation_id)
        return True

    def free(self, conversation_id: str) -> None:
        self._busy.remove(conversation_id)

    def _evictable(self, conversation_id: str) -> bool:
        return conversation_id not in self._busy

    def _evict(self, conversation_id: str) -> None:
        logger.info("Conversation %s evicted (least recently used)", conversation_id)
        super()._evict(conversation_id)
