"""OpenAI's Conversations API: `/v1/conversations` (create, get, update the metadata of, delete) and its items (add,
list, get, delete), and a conversation as the context of a `/v1/responses` request that names it (`conversation`).

Where a request goes: `parse_body` (`conversations_schemas.py`) -> the store (`conversations_store.py`, held by the
server state). Items are stored as the Responses API stores its input items (`responses_api_convert.stored_items`:
an id naming the replica that holds them, a status, a message's text as parts), and listed as they are.

A response on a conversation is given the conversation's items as they are when it starts, before its input; once
it has ended (completed, or incomplete: cut by `max_output_tokens`) its input and output are added to the
conversation in one step (`add_turn`); a response that failed or was cancelled adds nothing. One response runs on a
conversation at a time (`occupy`): a second meanwhile is OpenAI's 400 `conversation_locked`, and the store does not
evict a busy conversation. `store: false` keeps the response itself out of the response store, not its turn out of
the conversation, as OpenAI's does.

The store's byte bound (`--conversations-store-bytes`, OpenAI documents no limit on a conversation's size) is the
store's, not one conversation's: a turn that makes its conversation exceed it evicts other conversations (least
recently used first, none busy), and only one the store cannot hold even so (the conversation alone exceeds the
bound) is refused. A response whose conversation and input alone would exceed it is a 400 before it generates
(`check_turn_fits`); one whose output then makes it exceed it fails (status `failed`, its error saying why), its
turn not added, rather than ending as if it had been.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from sluice.app.conversations_schemas import (
    ConversationCreateRequest,
    ConversationObject,
    ConversationUpdateRequest,
    DeletedConversation,
    IncludeQuery,
    ItemsCreateRequest,
)
from sluice.app.conversations_store import StoredConversation
from sluice.app.errors import APIError, invalid_request
from sluice.app.response_ids import new_id
from sluice.app.responses_api_convert import ITEM, Items, check_ids_distinct, item_page, stored_items
from sluice.app.responses_api_schemas import ConversationReference, InputItemList, InputItemsQuery
from sluice.app.routes import json_response, parse_body, parse_query
from sluice.app.state import ServerState

logger = logging.getLogger(__name__)


def _not_found(conversation_id: str) -> APIError:
    """OpenAI's 404 for a conversation it does not hold (no `param`, no `code`)."""
    return APIError(404, f"Conversation with id '{conversation_id}' not found.")


async def create_conversation(request: Request) -> Response:
    state, _, body = await parse_body(request, ConversationCreateRequest)
    conversation_id = new_id("conv", state.replica)
    conversation, _ = _adding(state, StoredConversation(int(time.time()), body.metadata), body.items)
    _put(state, conversation_id, conversation)
    return _answer(conversation_id, conversation)


async def get_conversation(request: Request) -> Response:
    conversation_id = request.path_params["conversation_id"]
    return _answer(conversation_id, _held(_state(request), conversation_id))


async def update_conversation(request: Request) -> Response:
    """`POST /v1/conversations/{id}`: its metadata replaced by the request's."""
    state, _, body = await parse_body(request, ConversationUpdateRequest)
    conversation_id = request.path_params["conversation_id"]
    conversation = replace(_held(state, conversation_id), metadata=body.metadata or {})
    _put(state, conversation_id, conversation)
    return _answer(conversation_id, conversation)


async def delete_conversation(request: Request) -> Response:
    conversation_id = request.path_params["conversation_id"]
    if not _state(request).conversations.delete(conversation_id):
        raise _not_found(conversation_id)
    return json_response(DeletedConversation(id=conversation_id))


async def add_items(request: Request) -> Response:
    """`POST /v1/conversations/{id}/items`: the items added after the conversation's, as stored."""
    state, _, body = await parse_body(request, ItemsCreateRequest)
    parse_query(request, IncludeQuery)
    conversation_id = request.path_params["conversation_id"]
    conversation, added = _adding(state, _held(state, conversation_id), body.items)
    _put(state, conversation_id, conversation)
    return json_response(InputItemList.of(added, has_more=False))


async def list_items(request: Request) -> Response:
    """The conversation's items, `limit` at a time after the item `after`, newest first unless `order` is `asc`."""
    query = parse_query(request, InputItemsQuery)
    conversation_id = request.path_params["conversation_id"]
    return json_response(conversation_page(_held(_state(request), conversation_id), query, conversation_id))


def conversation_page(conversation: StoredConversation, query: InputItemsQuery, conversation_id: str
                      ) -> InputItemList:
    """A page of the conversation's items (`item_page`), of which only the page's are parsed."""
    return item_page(list(conversation.items), conversation.positions,
                     lambda item_id: ITEM.validate_json(conversation.items[item_id]), query,
                     f"conversation '{conversation_id}'")


async def get_item(request: Request) -> Response:
    parse_query(request, IncludeQuery)
    conversation = _held(_state(request), request.path_params["conversation_id"])
    return Response(_item_text(conversation, request.path_params["item_id"]), media_type="application/json")


async def delete_item(request: Request) -> Response:
    """Takes the item out of the conversation, and answers with the conversation (OpenAI's answer)."""
    state = _state(request)
    conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
    conversation = _held(state, conversation_id)
    _item_text(conversation, item_id)
    conversation = conversation.without_item(item_id)
    _put(state, conversation_id, conversation)
    return _answer(conversation_id, conversation)


def conversation_items(state: ServerState, conversation: ConversationReference | None) -> Items:
    """The items of the conversation a response continues, as they are now; none without one, a 404 for one the
    store does not hold."""
    return [] if conversation is None else _items(_held(state, conversation.id))


def occupy(state: ServerState, conversation: ConversationReference | None) -> Callable[[], None]:
    """Marks busy the conversation a response runs on, until the response has ended (whichever way) and calls what
    this returns (at once as its turn is added, and again as its stream closes: it frees once); a conversation the
    store does not hold is a 404 (one deleted while a response runs on it too), one busy already OpenAI's 400, in
    its words. Without one, nothing to free."""
    if conversation is None:
        return lambda: None
    _held(state, conversation.id)
    if not state.conversations.occupy(conversation.id):
        raise APIError(400, "Another process is currently operating on this conversation. Please retry in a few "
                            "seconds.", param="conversation", code="conversation_locked")
    occupied = [True]

    def free() -> None:
        if occupied:  # a second call must not free a later response's hold
            occupied.clear()
            state.conversations.free(conversation.id)

    return free


def holds_item(state: ServerState, conversation: ConversationReference | None, item_id: str) -> bool:
    """Whether this server holds an item by the id `item_id`: a stored response's, or the conversation's (if any);
    a client's id for an item is kept only then (`stored_items`)."""
    held = None if conversation is None else state.conversations.get(conversation.id)
    return (held is not None and item_id in held.items) or state.responses.holding(item_id) is not None


def check_turn_fits(state: ServerState, conversation: ConversationReference | None, items: Items) -> None:
    """A 400 where the conversation with a response's input `items` (as stored) would exceed the store's byte bound
    alone: its turn could never be added, so it is refused before it generates."""
    if conversation is not None:
        held = _held(state, conversation.id)
        if held.with_items(_new_texts(held, items)).size > state.conversations.max_bytes:
            raise invalid_request(too_large(conversation.id), param="input")


def add_turn(state: ServerState, conversation_id: str, items: Items) -> bool:
    """Adds a response's input and output `items` (as stored, with ids) to its conversation, in one step, evicting
    other conversations where the store's bounds ask; those it holds already (a client added them meanwhile) are not
    added twice. False where the store cannot hold it even so, the conversation kept as it was; a conversation
    deleted meanwhile gets nothing (and refused nothing)."""
    conversation = state.conversations.get(conversation_id)
    if conversation is None:
        return True
    if state.conversations.put(conversation_id, conversation.with_items(_new_texts(conversation, items))):
        return True
    logger.warning("A response's turn was not added to conversation %s: the store cannot hold it", conversation_id)
    return False


def too_large(conversation_id: str) -> str:
    return (f"Conversation '{conversation_id}' would exceed the server's store of conversations "
            "(--conversations-store-size, --conversations-store-bytes)")


def _adding(state: ServerState, conversation: StoredConversation, items: Items) -> tuple[StoredConversation, Items]:
    """The conversation with `items` added after its own, and those items as stored; an item whose id it holds (or
    given twice) is a 400, as OpenAI's."""
    check_ids_distinct([*conversation.items, *(item.id for item in items)], param="items")
    added = stored_items(items, state.replica, lambda item_id: state.responses.holding(item_id) is not None)
    return conversation.with_items(_texts(added)), added


def _texts(items: Items) -> dict[str, str]:
    """Stored items as a conversation holds them: each one's JSON, by its id."""
    return {item.id: item.model_dump_json() for item in items}


def _new_texts(conversation: StoredConversation, items: Items) -> dict[str, str]:
    """`_texts` of those of `items` the conversation does not hold."""
    return _texts([item for item in items if item.id not in conversation.items])


def _items(conversation: StoredConversation) -> Items:
    return [ITEM.validate_json(text) for text in conversation.items.values()]


def _item_text(conversation: StoredConversation, item_id: str) -> str:
    text = conversation.items.get(item_id)
    if text is None:
        raise APIError(404, f"Item with id '{item_id}' not found.")
    return text


def _put(state: ServerState, conversation_id: str, conversation: StoredConversation) -> None:
    if not state.conversations.put(conversation_id, conversation):
        raise invalid_request(too_large(conversation_id))


def _held(state: ServerState, conversation_id: str) -> StoredConversation:
    conversation = state.conversations.get(conversation_id)
    if conversation is None:
        raise _not_found(conversation_id)
    return conversation


def _answer(conversation_id: str, conversation: StoredConversation) -> Response:
    return json_response(ConversationObject(id=conversation_id, created_at=conversation.created_at,
                                            metadata=conversation.metadata))


def _state(request: Request) -> ServerState:
    return request.app.state.sluice
