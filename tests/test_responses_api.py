"""The Responses API (`/v1/responses`): its store and its conversion on their own, then the official `openai`
client's `client.responses` against a real `sluice serve` with SmolLM2 (greedy, short replies)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter, ValidationError

from test_api_e2e import API_KEY, AUTH, error_of, post, start_server

from sluice.app.errors import from_validation_error, generation_failed
from sluice.app.responses_api_builder import ResponsesBuilder
from sluice.app.response_ids import new_id, replica_of
from sluice.app.responses_api_convert import chat_request, output_items, stored_items
from sluice.app.responses_api_schemas import ItemReference, MessageItem, ResponseObject, ResponsesRequest, TextConfig
from sluice.app.schemas import TokenLogprobInfo
from sluice.batching.outputs import Increment, TokenLogprob, Usage
from sluice.app.responses_api_store import ResponseStore, StoredResponse

# --- the store and the conversion ---------------------------------------------------------------------------


def entry(size: int) -> StoredResponse:
    return StoredResponse("x" * size, "")


def test_the_store_evicts_the_least_recently_used_beyond_its_count():
    store = ResponseStore(max_count=2, max_bytes=1000)
    store.put("a", entry(1))
    store.put("b", entry(1))
    store.get("a")
    store.put("c", entry(1))
    assert (store.get("a"), store.get("b"), store.get("c")) == (entry(1), None, entry(1))


def test_the_store_evicts_the_oldest_beyond_its_bytes_and_keeps_none_larger_than_them():
    store = ResponseStore(max_count=10, max_bytes=100)
    for name in "abc":
        store.put(name, entry(40))
    assert (store.get("a"), len(store), store.bytes) == (None, 2, 80)
    store.put("huge", entry(101))
    assert (store.get("huge"), len(store)) == (None, 2)


def test_the_store_finds_an_item_while_a_response_holding_it_is_stored():
    store = ResponseStore(max_count=2, max_bytes=1000)
    first = StoredResponse("a", "", item_ids=frozenset({"msg_1"}))
    second = StoredResponse("b", "", item_ids=frozenset({"msg_1", "fc_2"}))
    store.put("a", first)
    store.put("b", second)
    store.delete("b")
    assert (store.holding("msg_1"), store.holding("fc_2")) == (first, None)
    store.put("c", entry(1))
    store.put("d", entry(1))
    assert store.holding("msg_1") is None


def test_an_item_with_an_id_and_no_type_or_role_is_an_item_reference():
    """OpenAI's item reference may leave out its type, as a message may."""
    assert ResponsesRequest.model_validate({"input": [{"id": "msg_1"}]}).input == [ItemReference(id="msg_1")]


def test_an_unsupported_field_that_asks_for_nothing_is_no_error():
    body = ResponsesRequest.model_validate({"input": "Hi", "background": False})
    assert body.input[0].content == "Hi"


@pytest.mark.parametrize(("reasoning", "effort"), [({"effort": "high", "summary": "auto"}, "high"),
                                                   ({"effort": None, "summary": None}, None), (None, None)])
def test_the_reasoning_effort_is_the_chat_requests_and_a_summary_asked_for_is_no_error(reasoning, effort):
    body = ResponsesRequest.model_validate({"input": "Hi", "reasoning": reasoning})
    assert chat_request(body, body.input).reasoning_effort == effort


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0", "of type 'web_search'"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "web_search_call", "id": "ws_1"}]}, "input.1",
     "items of type 'web_search_call' are not supported"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "of type 'web_search_preview'"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     '{"type": "function", "name": ...}'),
])
def test_a_hosted_tool_or_another_tool_choice_is_refused_by_what_it_is(fields, param, words):
    """Not by a field it lacks or the union's failed branches ("tools.0.name: Field required",
    "tool_choice.literal['none','auto','required']: ...", "Input tag ... found using item_type() ...")."""
    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate({"input": "x", **fields})
    error = from_validation_error(caught.value)
    assert error.param == param and words in error.message


def test_items_become_chat_messages_calls_joining_the_assistant_turn_before_them():
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]})
    chat = chat_request(body, body.input)
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Let me look."), ("tool", "sunny")]
    assert chat.messages[2].tool_calls[0].function.name == "get_weather"
    assert chat.messages[3].tool_call_id == "c1"


def test_reasoning_items_are_the_reasoning_of_the_assistant_turn_after_them():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}],
         "content": [{"type": "reasoning_text", "text": "Call get_weather."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "It is sunny."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Say so."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks."},
    ]})
    chat = chat_request(body, body.input)
    assert [(m.role, m.reasoning_content) for m in chat.messages] == [
        ("user", None), ("assistant", "Call get_weather."), ("tool", None), ("assistant", "It is sunny.\nSay so."),
        ("user", None)]


def test_reasoning_items_no_turn_of_theirs_follows_are_an_assistant_message_of_their_own():
    """A reply that was all reasoning (cut by max_output_tokens) stays in the conversation, as vLLM keeps it."""
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm, weigh"}]}
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather?"}, thought, {"role": "user", "content": "Well?"}, thought]})
    chat = chat_request(body, body.input)
    assert [(m.role, m.text(), m.reasoning_content) for m in chat.messages] == [
        ("user", "Weather?", None), ("assistant", "", "Hmm, weigh"), ("user", "Well?", None),
        ("assistant", "", "Hmm, weigh")]


@pytest.mark.parametrize("strict", [True, False, None])
def test_a_function_tools_strict_reaches_the_chat_request(strict):
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": strict}
    body = ResponsesRequest.model_validate({"input": "Weather?", "tools": [tool]})
    assert chat_request(body, body.input).holds_chosen_calls() is bool(strict)


class FailingGeneration:
    """A generation whose engine fails after its first text."""

    usage = None
    cancelled = False

    async def increments(self):
        yield Increment(choice=0, text="Hel", token_ids=(1,))
        raise generation_failed("generation failed: boom")


def blank_response() -> ResponseObject:
    return ResponseObject(id="resp_x", created_at=0, status="in_progress", instructions=None, max_output_tokens=None,
                          model="m", output=[], parallel_tool_calls=True, previous_response_id=None, temperature=1.0,
                          top_p=1.0, tool_choice="auto", tools=[], text=TextConfig(), store=True, metadata={})


def test_an_engine_error_after_the_200_is_a_response_failed_event_that_ends_the_stream():
    frames: list[bytes] = []
    ended: list[tuple[int, str]] = []  # how many frames had come, and the status, when the response was handed on

    async def read() -> None:
        builder = ResponsesBuilder(blank_response(), None, lambda done: ended.append((len(frames), done.status)))
        async for frame in builder.events(FailingGeneration()):
            frames.append(frame)

    asyncio.run(read())
    last = json.loads(frames[-1].decode().split("data: ", 1)[1])
    assert frames[-1].startswith(b"event: response.failed\n")
    assert last["response"]["status"] == "failed" and last["response"]["error"]["message"].endswith("boom")
    # Handed on before the last event, as a completed one is: its conversation is free when the client hears it.
    assert b"response.output_text.delta" in frames[-2] and ended == [(len(frames) - 1, "failed")]


def test_a_cancelled_stream_hands_its_response_on_before_its_last_event():
    class CancelledGeneration(FailingGeneration):
        cancelled = True

    frames: list[bytes] = []
    ended: list[tuple[int, str]] = []

    async def read() -> None:
        builder = ResponsesBuilder(blank_response(), None, lambda done: ended.append((len(frames), done.status)))
        async for frame in builder.events(CancelledGeneration()):
            frames.append(frame)

    asyncio.run(read())
    assert frames[-1].startswith(b"event: response.incomplete\n") and ended == [(len(frames) - 1, "cancelled")]


class ScriptedGeneration:
    """A generation whose increments are given (each token's logprob is minus its id)."""

    usage = Usage(prompt_tokens=3, completion_tokens=3)

    def __init__(self, *increments: tuple[str, tuple[int, ...], str | None]) -> None:
        self._increments = [Increment(0, text, ids, tuple(TokenLogprob(t, -float(t)) for t in ids), finish)
                            for text, ids, finish in increments]

    async def increments(self):
        for increment in self._increments:
            yield increment


def shown_logprobs(entries):
    return [TokenLogprobInfo(token=TOKEN_TEXT[e.token_id], logprob=e.logprob, bytes=[], top_logprobs=[])
            for e in entries]


TOKEN_TEXT = {1: "The", 2: " end", 3: "<|im_end|>"}


@pytest.mark.parametrize("increments", [
    [("The", (1,), None), (" end", (2,), None), ("", (3,), "stop")],
    [("The", (1,), None), (" end", (2, 3), "stop")],  # the stop token with the text before it
], ids=["stop-token-alone", "stop-token-with-text"])
def test_the_stop_tokens_logprob_is_left_out_whichever_increment_it_comes_in(increments):
    def build() -> ResponsesBuilder:
        return ResponsesBuilder(blank_response(), None, lambda _: None, shown_logprobs)

    async def run() -> tuple[ResponseObject, list[bytes]]:
        whole = await build().collect(ScriptedGeneration(*increments))
        return whole, [e async for e in build().events(ScriptedGeneration(*increments))]

    whole, frames = asyncio.run(run())
    [part] = whole.output[0].content
    deltas = [json.loads(f.decode().split("data: ", 1)[1])
              for f in frames if f.startswith(b"event: response.output_text.delta")]
    assert part.text == "The end" and [(e.token, e.logprob) for e in part.logprobs] == [("The", -1.0), (" end", -2.0)]
    assert [(e["token"], e["logprob"]) for d in deltas for e in d["logprobs"]] == [("The", -1.0), (" end", -2.0)]


def test_a_replicas_response_and_every_item_it_stores_name_that_replica():
    """Behind --replicas an item_reference then goes to the replica that stores its item (app/ingress.py), as
    previous_response_id goes to its response's."""
    response = blank_response().model_copy(update={"id": new_id("resp", "r7x2")})
    done = asyncio.run(ResponsesBuilder(response, None, lambda _: None).collect(
        ScriptedGeneration(("The", (1,), None), (" end", (2,), "stop"))))
    stored = stored_items([MessageItem(role="user", content="Hi")] + output_items(done.output), "r7x2")
    assert [replica_of(item.id) for item in [done, *stored]] == ["r7x2"] * 3
    assert replica_of(stored_items(stored[:1], "")[0].id) == "r7x2"  # an item keeps its id
    assert replica_of(stored_items([MessageItem(role="user", content="Hi")], "")[0].id) is None


# --- the openai client against a real server ----------------------------------------------------------------

MODEL = "smollm2-responses"
STORE_SIZE = 3
FLAGS = ["--skip-server-warmup", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
         "--kv-cache-memory", "96MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui",
         "--responses-store-size", str(STORE_SIZE)]
RESPONSE_ITEM = TypeAdapter(ResponseItem)  # the client's own check (it builds its models without one)
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_a_string_input_is_answered_in_one_message_with_usage(client):
    reply = client.responses.create(input="What is the capital of France?", **GREEDY)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.output_text == message.content[0].text != ""
    usage = reply.usage
    assert usage.output_tokens == 12 and usage.total_tokens == usage.input_tokens + 12
    assert usage.input_tokens_details.cached_tokens >= 0


def test_usage_has_every_field_the_openai_types_require(server):
    reply = post(server, "/v1/responses", {"input": "Hi", **GREEDY}).json()
    usage = openai.types.responses.ResponseUsage.model_validate(reply["usage"])
    assert usage.input_tokens_details.cache_write_tokens == 0


def test_running_out_of_max_output_tokens_is_incomplete(client):
    reply = client.responses.create(input="Tell me a long story.", **GREEDY)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


def test_items_with_instructions_are_the_same_prompt_as_the_chat_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "What is 2+2?"}]
    reply = client.responses.create(input=items, instructions="Answer in one word.", **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi!"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


# A question, the call a reasoning model made for it (its reasoning first), and the call's output.
CALL = [{"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"}]
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Check the weather."}],
             "content": [{"type": "reasoning_text", "text": "The user wants Paris; call get_weather."}],
             "encrypted_content": None}


def test_a_reasoning_item_stays_in_the_conversation_and_a_template_that_does_not_read_it_shows_nothing(client):
    without = client.responses.create(input=CALL, tools=[WEATHER], **GREEDY)
    reply = client.responses.create(input=[CALL[0], REASONING, *CALL[1:]], tools=[WEATHER], **GREEDY)
    assert (reply.usage.input_tokens, reply.output_text) == (without.usage.input_tokens, without.output_text)
    items = client.responses.input_items.list(reply.id, order="asc").data
    assert [item.type for item in items] == ["message", "reasoning", "function_call", "function_call_output"]
    # An id a client chose is replaced when stored (`stored_items`).
    assert items[1].id.startswith("rs_") and items[1].id != "rs_1"
    assert items[1].summary[0].text == "Check the weather."


def test_text_written_after_a_call_is_the_calls_assistant_turn_as_vllm_joins_them(server, client):
    """A reply whose output is a call and then text (its items in the order the model wrote them) was one turn:
    as two, the template showed a turn that ended on its call, then another with no call before the call's output."""
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]}
    reply = client.responses.create(input=[*CALL[:2], said, CALL[2]], tools=[WEATHER],
                                    **{**GREEDY, "max_output_tokens": 1})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [CALL[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    tools = [{"type": "function", "function": {key: value for key, value in WEATHER.items() if key != "type"}}]
    assert reply.usage.input_tokens == post(server, "/tokenize", {"messages": messages, "tools": tools}).json()["count"]


def test_input_tokens_counts_the_prompt_a_response_would_have(client):
    """The openai client's `responses.input_tokens.count`: the same prompt a response to the request is given, an
    earlier response's conversation included."""
    reply = client.responses.create(input=CALL, tools=[WEATHER], instructions="Be brief.", **GREEDY)
    counted = client.responses.input_tokens.count(model=MODEL, input=CALL, tools=[WEATHER], instructions="Be brief.")
    assert counted.object == "response.input_tokens" and counted.input_tokens == reply.usage.input_tokens
    follow_up = {"previous_response_id": reply.id, "input": "And in Rome?", "tools": [WEATHER]}
    assert (client.responses.input_tokens.count(model=MODEL, **follow_up).input_tokens
            == client.responses.create(**follow_up, **GREEDY).usage.input_tokens)
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not found"):
        client.responses.input_tokens.count(model=MODEL, input="Hi", previous_response_id="resp_none")


def test_an_assistant_messages_refusal_is_its_text(client):
    def reply_after(part: dict):
        return client.responses.create(input=[{"role": "user", "content": "Tell me a secret."},
                                              {"role": "assistant", "content": [part]},
                                              {"role": "user", "content": "Why not?"}], **GREEDY)

    refused = reply_after({"type": "refusal", "refusal": "I can't share that."})
    said = reply_after({"type": "output_text", "text": "I can't share that."})
    assert (refused.usage.input_tokens, refused.output_text) == (said.usage.input_tokens, said.output_text)


def test_item_references_stand_for_the_stored_items_they_name(client):
    first = client.responses.create(input="My name is Ann.", **GREEDY)
    [question] = client.responses.input_items.list(first.id).data
    again = [{"type": "item_reference", "id": question.id}, {"type": "item_reference", "id": first.output[0].id}]
    referenced = client.responses.create(input=[*again, {"role": "user", "content": "What is my name?"}], **GREEDY)
    continued = client.responses.create(input="What is my name?", previous_response_id=first.id, **GREEDY)
    assert (referenced.usage.input_tokens, referenced.output_text) == (continued.usage.input_tokens,
                                                                       continued.output_text)
    items = client.responses.input_items.list(referenced.id, order="asc").data
    assert [item.id for item in items[:2]] == [question.id, first.output[0].id]


def test_an_item_reference_to_no_stored_item_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=[{"type": "item_reference", "id": "msg_nowhere"}], **GREEDY)
    assert "msg_nowhere" in caught.value.body["message"] and caught.value.body["param"] == "input"


def test_an_item_the_conversation_already_holds_is_a_400_naming_it_as_openais(client):
    """A client that continues a response and sends its items again (by reference, as some SDKs do) would show
    the model that turn twice; OpenAI refuses such a request ("Duplicate item found with id ...")."""
    first = client.responses.create(input="My name is Ann.", **{**GREEDY, "max_output_tokens": 2})
    again = {"type": "item_reference", "id": first.output[0].id}
    for fields in ({"previous_response_id": first.id}, {"input": [again, again]}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{"input": [again, {"role": "user", "content": "And?"}], **fields, **GREEDY})
        assert first.output[0].id in caught.value.body["message"] and caught.value.body["param"] == "input"


def test_streamed_deltas_reassemble_to_the_unstreamed_text_in_openais_event_order(client):
    whole = client.responses.create(input="Name a fruit.", **GREEDY)
    events = list(client.responses.create(input="Name a fruit.", stream=True, **GREEDY))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_puts_the_earlier_turn_before_the_new_input_without_its_instructions(server, client):
    """OpenAI's rule: the earlier response's `instructions` are not carried over, only its input and output."""
    first = client.responses.create(input="My name is Ann.", instructions="Answer in French.", **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **GREEDY)
    messages = [{"role": "user", "content": "My name is Ann."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    prompt = post(server, "/tokenize", {"messages": messages}).json()
    assert second.usage.input_tokens == prompt["count"]
    assert second.previous_response_id == first.id


def test_the_store_keeps_the_newest_and_an_evicted_id_is_gone(server, client):
    ids = [client.responses.create(input=f"Count to {i}.", **{**GREEDY, "max_output_tokens": 1}).id
           for i in range(STORE_SIZE + 1)]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    error = error_of(httpx.get(f"{server.url}/v1/responses/{ids[0]}", headers=AUTH), 404)
    assert ids[0] in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input="Go on.", previous_response_id=ids[0], **GREEDY)


def test_an_unstored_or_deleted_response_is_gone(client):
    unstored = client.responses.create(input="Hi", store=False, **{**GREEDY, "max_output_tokens": 1})
    stored = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    client.responses.delete(stored.id)
    for response_id in (unstored.id, stored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
        # Nor can a conversation go on from it: OpenAI's 400 for an id it does not hold.
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(input="Go on.", previous_response_id=response_id, **GREEDY)
        assert caught.value.body["code"] == "previous_response_not_found"


def test_streaming_a_stored_response_again_is_a_400_not_its_json_read_as_an_empty_stream(client):
    """Only a background response created with `stream: true` is streamed again (tests/test_responses_background.py),
    as OpenAI's."""
    stored = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    with pytest.raises(openai.BadRequestError) as caught:
        list(client.responses.retrieve(stored.id, stream=True))
    assert caught.value.body["param"] == "stream"
    assert client.responses.retrieve(stored.id, stream=False).id == stored.id


def test_a_required_call_follows_the_schema_and_its_output_continues_the_conversation(client):
    reply = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, model=MODEL, temperature=0, max_output_tokens=60)
    [call] = reply.output
    assert reply.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = client.responses.create(
        previous_response_id=reply.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}], **GREEDY)
    assert answer.output[0].type == "message"
    assert answer.usage.input_tokens > reply.usage.input_tokens + reply.usage.output_tokens


def test_a_streamed_call_sends_its_arguments_in_fragments_that_join_to_the_unstreamed_call(client):
    fields = {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
              "model": MODEL, "temperature": 0, "max_output_tokens": 60}
    [call] = client.responses.create(**fields).output
    events = list(client.responses.create(stream=True, **fields))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(fragments) == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "get_weather"


def test_a_json_schema_text_format_gives_json_that_follows_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.responses.create(input="Describe a person as JSON.", model=MODEL, temperature=0,
                                    max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert reply.text.format.type == "json_schema"


def test_included_logprobs_come_with_the_text_whole_and_in_its_deltas(client):
    fields = {"input": "Name a fruit.", "include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    whole = client.responses.create(**fields)
    part = whole.output[0].content[0]
    assert whole.top_logprobs == 2 and 0 < len(part.logprobs) <= whole.usage.output_tokens  # EOS has no text
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    events = list(client.responses.create(stream=True, **fields))
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in done.logprobs] == [
        (e.token, e.logprob) for e in part.logprobs]


def test_without_include_there_are_no_logprobs(client):
    assert client.responses.create(input="Hi", **GREEDY).output[0].content[0].logprobs == []


def test_input_items_list_the_conversation_before_the_output_newest_first_in_pages(client):
    first = client.responses.create(input="My name is Ann.", **{**GREEDY, "max_output_tokens": 2})
    second = client.responses.create(input=[{"role": "user", "content": "And yours?"}], previous_response_id=first.id,
                                     **{**GREEDY, "max_output_tokens": 2})
    items = client.responses.input_items.list(second.id).data
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert [item.content[0].text for item in items] == ["And yours?", first.output_text, "My name is Ann."]
    assert items[1].id == first.output[0].id and all(item.id for item in items)
    assert [item.status for item in items] == ["completed", first.output[0].status, "completed"]
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [items[2].id, items[1].id] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [item.id for item in rest.data] == [items[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=101)


def test_input_items_are_the_openai_clients_types_an_assistants_text_output_text_and_anothers_input_text(server,
                                                                                                         client):
    """Whatever part (or string) a message's text came as: the client's types require an output text's
    annotations, and have no output text in a user's message nor input text in an assistant's."""
    first = client.responses.create(input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": [{"type": "input_text", "text": "I am Sluice."}]},
        {"role": "user", "content": "Who are you?"}], **{**GREEDY, "max_output_tokens": 2})
    second = client.responses.create(input="Go on.", previous_response_id=first.id, **{**GREEDY, "max_output_tokens": 2})
    listed = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params={"order": "asc"},
                       headers=AUTH).json()["data"]
    items = [RESPONSE_ITEM.validate_python(item) for item in listed]
    assert [(item.role, item.content[0].type) for item in items] == [
        ("developer", "input_text"), ("user", "input_text"), ("assistant", "output_text"),
        ("assistant", "output_text"), ("user", "input_text"), ("assistant", "output_text"), ("user", "input_text")]
    assert [item.content[0].annotations for item in items if item.role == "assistant"] == [[], [], []]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}],
      "tool_choice": "required"}, "tools.0.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"input": [{"role": "oracle", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}, "input.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.arguments"),
    ({"temperature": 3}, "temperature"),
    ({"background": True, "store": False}, "background"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"include": ["message.output_text.everything"]}, "include.0"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_bad_fields_are_400_in_openai_shape(server, fields, param):
    error = error_of(post(server, "/v1/responses", {"model": MODEL, "input": "x", **fields}), 400)
    assert error["param"] == param, error


def test_an_unknown_previous_response_id_is_openais_400_whose_code_clients_recover_by(server):
    """Clients (Codex's proxies, agent frameworks) match the code to send the whole conversation again."""
    error = error_of(post(server, "/v1/responses", {"input": "x", "previous_response_id": "resp_unknown"}), 400)
    assert error == {"message": "Previous response with id 'resp_unknown' not found.", "type": "invalid_request_error",
                     "param": "previous_response_id", "code": "previous_response_not_found"}


def test_a_function_call_output_that_answers_no_earlier_call_is_400(server):
    unanswered = {"type": "function_call_output", "call_id": "call_nope", "output": "Sunny"}
    error = error_of(post(server, "/v1/responses", {"model": MODEL, "input": [unanswered]}), 400)
    assert error["param"] == "input" and "call_nope" in error["message"]


def test_a_function_call_left_unanswered_is_400_as_openais(client):
    """In the input or brought by previous_response_id: the model would be shown a call that had no result."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=[{"role": "user", "content": "Weather in Oslo?"}, call], **GREEDY)
    assert caught.value.body["message"] == "No tool output found for function call call_1."
    called = client.responses.create(input="Weather in Oslo?", tools=[WEATHER], model=MODEL, temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="Never mind.", previous_response_id=called.id, **GREEDY)
    assert called.output[0].call_id in caught.value.body["message"] and caught.value.body["param"] == "input"


def test_a_call_written_whole_before_max_output_tokens_ran_out_is_completed_and_can_be_answered(client):
    fields = {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
              "model": MODEL, "temperature": 0}
    whole = client.responses.create(max_output_tokens=60, **fields)
    # One token short: the call's object is written, what ends the reply after it (its close, the EOS) is not.
    cut = client.responses.create(max_output_tokens=whole.usage.output_tokens - 1, **fields)
    [call] = cut.output
    assert cut.status == "incomplete" and call.status == "completed" and call.arguments == whole.output[0].arguments
    answer = client.responses.create(
        previous_response_id=cut.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}], **GREEDY)
    items = client.responses.input_items.list(answer.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]


def test_a_forced_call_cut_before_its_arguments_leaves_no_markup_in_the_output_or_the_conversation(client):
    fields = {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required", "model": MODEL,
              "temperature": 0}
    cut = client.responses.create(max_output_tokens=3, **fields)
    assert cut.status == "incomplete" and cut.usage.output_tokens == 3
    assert not [item for item in cut.output if item.type == "message" and "".join(
        part.text for part in item.content if part.type == "output_text")]
    assert all(item.type != "function_call" for item in cut.output)


def test_truncation_auto_drops_the_oldest_whole_turns_after_the_opening_and_disabled_is_a_400(server, client):
    turns = [[{"role": "user", "content": f"Note {i}: " + "apple pear plum " * 100},
              {"role": "assistant", "content": f"Noted {i}."}] for i in range(5)]  # about 300 tokens a turn
    conversation = [item for turn in turns for item in turn] + [{"role": "user", "content": "What was the last note?"}]
    refused = post(server, "/v1/responses", {"input": conversation, **GREEDY})
    assert "maximum context length" in error_of(refused, 400)["message"]
    reply = client.responses.create(input=conversation, truncation="auto", **GREEDY)
    assert reply.truncation == "auto" and reply.usage.input_tokens + 12 <= 1024
    kept = client.responses.input_items.list(reply.id, order="asc", limit=100).data
    assert kept[0].content[0].text.startswith("Note 0:") and kept[1].role == "user"  # the opening, then a turn
    assert kept[-1].content[0].text == "What was the last note?" and 3 <= len(kept) < len(conversation)
    # The latest turns that fit: one more would not have.
    more = conversation[:1] + conversation[-len(kept) - 1:]
    assert client.responses.create(input=more, truncation="auto", **GREEDY).usage.input_tokens == \
        reply.usage.input_tokens


@pytest.mark.parametrize("opening", ["user", "developer"])  # without a user message, the instructions stay
def test_truncation_auto_drops_an_agents_oldest_calls_with_their_outputs(client, opening):
    steps = [[{"type": "function_call", "call_id": f"call_{i}", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
              {"type": "function_call_output", "call_id": f"call_{i}", "output": f"Reading {i}: " + "cold wind " * 150}]
             for i in range(6)]  # about 300 tokens a step
    conversation = [{"role": opening, "content": "Watch the weather in Oslo."}] + [item for step in steps for item in step]
    reply = client.responses.create(input=conversation, tools=[WEATHER], truncation="auto", **GREEDY)
    kept = client.responses.input_items.list(reply.id, order="asc", limit=100).data
    assert kept[0].type == "message" and kept[0].role == opening and 3 <= len(kept) < len(conversation)
    assert [item.type for item in kept[1:]] == ["function_call", "function_call_output"] * ((len(kept) - 1) // 2)
    assert kept[-1].call_id == "call_5" and kept[1].call_id == kept[2].call_id


class BrokenGeneration:
    """A generation whose reading fails after its first text, as a bug would (not an engine error)."""

    usage = None
    cancelled = False

    async def increments(self):
        yield Increment(choice=0, text="Hel", token_ids=(1,))
        raise RuntimeError("a bug")


def test_a_bug_mid_stream_is_a_response_failed_event_too():
    async def events() -> list[bytes]:
        return [e async for e in ResponsesBuilder(blank_response(), None, lambda done: None).events(BrokenGeneration())]

    last = asyncio.run(events())[-1]
    assert last.startswith(b"event: response.failed\n")
    assert json.loads(last.decode().split("data: ", 1)[1])["response"]["error"]["message"] == "Internal server error"
