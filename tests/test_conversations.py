"""OpenAI's Conversations API (`/v1/conversations`) and `conversation` on `/v1/responses`: the store on its own, then
the official `openai` client's `client.conversations` and the Agents SDK's `OpenAIConversationsSession` against a
real `sluice serve` with SmolLM2 (greedy, short replies)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIConversationsSession, OpenAIResponsesModel, Runner, RunResult

from test_agents_sdk import MODEL, server  # noqa: F401 - its server fixture: one SmolLM2 server for the module
from test_api_e2e import API_KEY, AUTH, error_of, post
from test_responses_api import client  # noqa: F401 - its fixture: an openai client of that server

from sluice.app.conversations import conversation_page
from sluice.app.conversations_store import ConversationStore, StoredConversation
from sluice.app.openapi import openapi_document
from sluice.app.responses_api_schemas import ConversationReference, InputItemsQuery, ResponsesRequest
from sluice.app.server import ROUTES

# --- the store ----------------------------------------------------------------------------------------------


def conversation(*items: str) -> StoredConversation:
    return StoredConversation(created_at=0, metadata={}).with_items({f"msg_{i}": text for i, text in enumerate(items)})


def test_the_store_evicts_the_least_recently_used_beyond_its_count_or_bytes():
    store = ConversationStore(max_count=2, max_bytes=1000)
    for name in "ab":
        store.put(name, conversation("x" * 10))
    store.get("a")
    store.put("c", conversation("x" * 10))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (True, None, True)
    store.put("a", conversation("x" * 600))  # it and c's exceed the bytes
    assert (store.get("c"), len(store), store.bytes) == (None, 1, conversation("x" * 600).size)


def test_a_conversation_larger_than_the_byte_bound_alone_is_refused_and_the_one_stored_kept():
    store = ConversationStore(max_count=2, max_bytes=1000)
    store.put("a", conversation("x"))
    assert not store.put("a", conversation("x" * 1000))
    assert store.get("a") == conversation("x")


def test_a_busy_conversation_is_not_evicted_and_each_eviction_is_logged(caplog):
    """A response running on a conversation adds its turn to it when it ends: evicted meanwhile, the turn is lost."""
    store = ConversationStore(max_count=2, max_bytes=10_000)
    store.put("a", conversation("x"))
    assert store.occupy("a")
    with caplog.at_level(logging.INFO, logger="sluice.app.conversations_store"):
        for name in "bc":
            store.put(name, conversation("x"))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (True, None, True)
    assert [record.getMessage() for record in caplog.records] == ["Conversation b evicted (least recently used)"]


def test_a_conversation_that_fits_only_by_evicting_a_busy_one_is_refused():
    store = ConversationStore(max_count=1, max_bytes=10_000)
    store.put("a", conversation("x"))
    store.occupy("a")
    assert not store.put("b", conversation("x")) and store.get("a") is not None
    store.free("a")
    assert store.put("b", conversation("x")) and store.get("a") is None


def test_a_conversation_is_occupied_by_one_response_at_a_time():
    store = ConversationStore(max_count=2, max_bytes=1000)
    assert store.occupy("a") and not store.occupy("a") and store.occupy("b")
    store.free("a")
    assert store.occupy("a")


def test_a_conversations_size_counts_its_items_ids_and_what_each_costs_beyond_its_text():
    empty = StoredConversation(created_at=0, metadata={})
    short, long = empty.with_items({"m": "x"}), empty.with_items({"m" * 101: "x"})
    assert long.size - short.size == 100 and short.size - empty.size > 100
    assert short.without_item("m").size < short.size


def test_a_listing_parses_only_the_items_of_its_page():
    """A long conversation's page costs the event loop its own items, not the conversation's."""
    held = conversation(*(["not JSON"] * 1000 + [json.dumps({"id": f"msg_{i}", "role": "user", "content": "x"})
                                                 for i in range(1000, 1003)]))
    page = conversation_page(held, InputItemsQuery(limit=2, after="msg_1002"), "c")
    assert ([item.id for item in page.data], page.has_more) == (["msg_1001", "msg_1000"], True)


def test_a_responses_conversation_is_documented_as_its_id_or_an_object_and_read_as_the_object():
    """The string is OpenAI's main form (its clients' `conversation: str | {id}`)."""
    schemas = openapi_document([operation for _, operation in ROUTES], "sluice", "0", False, frozenset())
    variants = schemas["components"]["schemas"]["ResponsesRequest"]["properties"]["conversation"]["anyOf"]
    assert variants == [{"type": "string"}, {"$ref": "#/components/schemas/ConversationReference"}, {"type": "null"}]
    assert ResponsesRequest.model_validate({"input": "Hi", "conversation": "conv_1"}).conversation == \
        ConversationReference(id="conv_1")


# --- the openai client against a real server ----------------------------------------------------------------

GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
ANN = {"role": "user", "content": "My name is Ann."}


def test_a_conversation_is_created_retrieved_updated_and_deleted(client):
    created = client.conversations.create(metadata={"topic": "demo"}, items=[ANN])
    assert created.id.startswith("conv_") and created.object == "conversation" and created.metadata == {
        "topic": "demo"}
    assert client.conversations.retrieve(created.id) == created
    updated = client.conversations.update(created.id, metadata={"topic": "names"})
    assert (updated.id, updated.created_at, updated.metadata) == (created.id, created.created_at, {"topic": "names"})
    deleted = client.conversations.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(created.id)


def test_items_are_added_listed_newest_first_paged_retrieved_and_deleted(client):
    conversation = client.conversations.create(items=[ANN, {"role": "assistant", "content": "Hello, Ann."}])
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output"]
    assert (added.first_id, added.last_id, added.has_more) == (added.data[0].id, added.data[-1].id, False)
    newest_first = client.conversations.items.list(conversation.id).data
    assert [item.id for item in newest_first[:3]] == [item.id for item in reversed(added.data)]
    assert [item.role for item in newest_first[3:]] == ["assistant", "user"]
    assert newest_first[4].content[0].type == "input_text" and newest_first[3].content[0].type == "output_text"

    page = client.conversations.items.list(conversation.id, order="asc", limit=2)
    assert page.has_more and [item.id for item in page.data] == [item.id for item in newest_first[:-3:-1]]
    every = client.conversations.items.list(conversation.id, order="asc", limit=2)
    assert [item.id for item in every] == [item.id for item in reversed(newest_first)]  # pages after last_id

    call = added.data[1]
    assert client.conversations.items.retrieve(call.id, conversation_id=conversation.id) == call
    assert client.conversations.items.delete(call.id, conversation_id=conversation.id) == conversation
    assert call.id not in [item.id for item in client.conversations.items.list(conversation.id)]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(call.id, conversation_id=conversation.id)


def test_a_listing_after_a_deleted_item_goes_on_from_where_it_was(client):
    conversation = client.conversations.create(items=[{"role": "user", "content": str(i)} for i in range(5)])
    first = client.conversations.items.list(conversation.id, order="asc", limit=2)
    client.conversations.items.delete(first.last_id, conversation_id=conversation.id)
    after = client.conversations.items.list(conversation.id, order="asc", limit=2, after=first.last_id)
    before = client.conversations.items.list(conversation.id, limit=2, after=first.last_id)
    assert [[item.content[0].text for item in page.data] for page in (after, before)] == [["2", "3"], ["0"]]
    assert (after.has_more, before.has_more) == (True, False)
    with pytest.raises(openai.BadRequestError, match="msg_never"):
        client.conversations.items.list(conversation.id, after="msg_never")


def test_a_response_in_a_conversation_sees_its_items_and_is_added_to_it(server, client):
    conversation = client.conversations.create()
    first = client.responses.create(input="My name is Ann.", conversation=conversation.id, **GREEDY)
    counted = client.responses.input_tokens.count(model=MODEL, input="What is my name?", conversation=conversation.id)
    second = client.responses.create(input="What is my name?", conversation={"id": conversation.id}, **GREEDY)
    assert second.conversation.id == conversation.id and counted.input_tokens == second.usage.input_tokens
    messages = [ANN, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == post(server, "/tokenize", {"messages": messages}).json()["count"]
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in items] == [
        (message["role"], message["content"]) for message in messages] + [("assistant", second.output_text)]
    assert [items[1].id, items[3].id] == [first.output[0].id, second.output[0].id]


def test_input_tokens_without_input_counts_the_conversation_or_the_earlier_response(server, client):
    """`input` is optional in OpenAI's reference there: what a conversation or an earlier response holds is
    counted; with neither, there is nothing to count."""
    conversation = client.conversations.create(items=[ANN])
    first = client.responses.create(input=ANN["content"], **GREEDY)
    counted = [client.responses.input_tokens.count(model=MODEL, **context).input_tokens
               for context in ({"conversation": conversation.id}, {"previous_response_id": first.id})]
    prompts = [post(server, "/tokenize", {"messages": messages}).json()["count"]
               for messages in ([ANN], [ANN, {"role": "assistant", "content": first.output_text}])]
    assert counted == prompts
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_tokens.count(model=MODEL)
    assert caught.value.body["param"] == "input"


def test_item_ids_a_client_chose_are_replaced_so_they_neither_collide_nor_reach_anothers_items(client):
    """Only ids this server holds an item by are kept (an earlier output item's, sent back): `msg_shared` in two
    conversations names neither, nor can an item_reference reach a stored item by it."""
    shared = {"type": "message", "id": "msg_shared", "role": "user", "content": "Mine."}
    ids = [client.conversations.items.list(client.conversations.create(items=[shared]).id).data[0].id
           for _ in range(2)]
    reply = client.responses.create(input=[shared], **GREEDY)
    [stored] = client.responses.input_items.list(reply.id).data
    assert len({*ids, stored.id, "msg_shared"}) == 4 and all(item_id.startswith("msg_") for item_id in ids)
    with pytest.raises(openai.BadRequestError, match="msg_shared"):
        client.responses.create(input=[{"type": "item_reference", "id": "msg_shared"}], **GREEDY)
    kept = client.conversations.create(items=[{**ANN, "type": "message", "id": reply.output[0].id}])
    assert client.conversations.items.list(kept.id).data[0].id == reply.output[0].id


def test_a_streamed_unstored_response_is_added_to_its_conversation_as_openai_adds_it(client):
    """`store: false` keeps the response itself out of the store, not its turn out of the conversation."""
    conversation = client.conversations.create()
    events = list(client.responses.create(input="Hi", conversation=conversation.id, stream=True, store=False,
                                          **GREEDY))
    done = events[-1].response
    assert [item.id for item in client.conversations.items.list(conversation.id).data][0] == done.output[0].id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def test_a_conversation_and_a_previous_response_id_together_are_openais_400(client):
    conversation = client.conversations.create()
    first = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    with pytest.raises(openai.BadRequestError, match="Mutually exclusive parameters"):
        client.responses.create(input="Go on.", conversation=conversation.id, previous_response_id=first.id,
                                **GREEDY)
    assert client.conversations.items.list(conversation.id).data == []


def test_an_unknown_conversation_or_item_is_a_404_in_openais_shape(server, client):
    conversation = client.conversations.create(items=[ANN])
    missing_item = f"{conversation.id}/items/msg_none"
    unknown = [(method, "conv_none", "conv_none") for method in ("GET", "POST", "DELETE")]
    unknown += [("GET", "conv_none/items", "conv_none"), ("GET", missing_item, "msg_none"),
                ("DELETE", missing_item, "msg_none")]
    for method, path, missing in unknown:
        answer = httpx.request(method, f"{server.url}/v1/conversations/{path}", headers=AUTH, json={"metadata": {}})
        assert error_of(answer, 404)["message"].endswith(f"with id '{missing}' not found."), (method, path)
    with pytest.raises(openai.NotFoundError, match="conv_none"):
        client.responses.create(input="Hi", conversation="conv_none", **GREEDY)


def test_more_than_twenty_items_or_an_item_held_already_is_a_400(client):
    conversation = client.conversations.create(items=[ANN])
    with pytest.raises(openai.BadRequestError):
        client.conversations.create(items=[ANN] * 21)
    [held] = client.conversations.items.list(conversation.id).data
    with pytest.raises(openai.BadRequestError, match=held.id):
        client.conversations.items.create(conversation.id, items=[{**ANN, "id": held.id}])


# --- the Agents SDK ---------------------------------------------------------------------------------------


def agent(client: openai.AsyncOpenAI) -> Agent:
    """An agent without tools whose replies end before max_tokens (the SDK refuses a reply it cut)."""
    return Agent(name="greeter", instructions="Answer in one short sentence.",
                 model=OpenAIResponsesModel(MODEL, client),
                 model_settings=ModelSettings(temperature=0, max_tokens=200))


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_an_agents_conversations_session_keeps_its_turns_in_a_conversation(server, client):
    """The session lists the conversation's items before each run and adds the run's new items after it."""
    sdk_client = async_client(server)
    greeter = agent(sdk_client)

    async def two_turns() -> tuple[str, list]:
        session = OpenAIConversationsSession(openai_client=sdk_client)
        await Runner.run(greeter, "My name is Ann.", session=session)
        await Runner.run(greeter, "What is my name?", session=session)
        return session.session_id, await session.get_items()

    conversation_id, items = asyncio.run(two_turns())
    listed = client.conversations.items.list(conversation_id, order="asc").data
    assert [item.role for item in listed] == ["user", "assistant", "user", "assistant"]
    assert [item["id"] for item in items] == [item.id for item in listed]
    assert listed[2].content[0].text == "What is my name?"


def test_an_agent_run_on_a_conversation_id_continues_it(server, client):
    """`Runner.run(..., conversation_id=...)`: each request names the conversation and sends only the new input; the
    second turn's prompt holds the first."""
    greeter = agent(async_client(server))
    conversation = client.conversations.create()

    async def two_turns() -> tuple[RunResult, RunResult]:
        return (await Runner.run(greeter, "My name is Ann.", conversation_id=conversation.id),
                await Runner.run(greeter, "What is my name?", conversation_id=conversation.id))

    first, second = asyncio.run(two_turns())
    messages = [{"role": "system", "content": greeter.instructions}, ANN,
                {"role": "assistant", "content": first.final_output}, {"role": "user", "content": "What is my name?"}]
    prompt = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert second.context_wrapper.usage.input_tokens == prompt
    listed = client.conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in listed] == [
        (message["role"], message["content"]) for message in messages[1:]] + [("assistant", second.final_output)]
