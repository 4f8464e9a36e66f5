"""Pydantic models of OpenAI's Conversations API (`/v1/conversations`): the requests that create and change a
conversation or add items to it, and the conversation as returned. Its items are the Responses API's input items
(`responses_api_schemas.py`), listed as a response's input items are (`InputItemList`, `InputItemsQuery`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.app.responses_api_schemas import AddedItem, Includable, Metadata
from sluice.app.schemas import _Request

# OpenAI's limit on the items one request adds (at creation, or to a conversation).
MAX_ADDED_ITEMS = 20


class ConversationCreateRequest(_Request):
    items: list[AddedItem] = Field(default_factory=list, max_length=MAX_ADDED_ITEMS,
                                   description="the conversation's first items")
    metadata: Metadata = Field(default_factory=dict)


class ConversationUpdateRequest(BaseModel):
    """`metadata` replaces the conversation's; it is required, and null clears it (OpenAI's `Required[Optional]`)."""

    model_config = ConfigDict(extra="ignore")

    metadata: Metadata | None


class ItemsCreateRequest(_Request):
    items: list[AddedItem] = Field(max_length=MAX_ADDED_ITEMS, description="added after the conversation's items")


class IncludeQuery(_Request):
    """The query of the routes that answer with items: `include` is accepted, and adds nothing (as on
    `GET /v1/responses/{id}`: no item here holds what it names)."""

    include: list[Includable] = Field(default_factory=list)


class ConversationObject(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class DeletedConversation(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True
