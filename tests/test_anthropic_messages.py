"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official `anthropic` client
against a real `sluice serve` with a tiny random model (ChatML template, no tools of its own: tools go the default
Hermes way, and `any` / `tool` choices are forced by the grammar, so calls are valid whatever the weights)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from jiter import from_json
from pydantic import BaseModel, ValidationError

from sluice.app.anthropic_errors import error_response_for
from sluice.app.anthropic_messages import chat_request
from sluice.app.anthropic_responses import MessageBuilder
from sluice.app.anthropic_schemas import MessagesRequest
from sluice.app.errors import not_ready, queue_full
from sluice.app.tool_calls import ToolCalling
from sluice.batching.outputs import Increment, Usage
from sluice.model.config import ModelConfig

from conftest import home_with_built_kernels
from hf_folder import CHATML, write_hf_folder
from test_api_e2e import API_KEY, start_server

MODEL = "tiny-anthropic"
# The tools prompt is long in a byte-level vocabulary of 288 tokens (the model's and the tokenizer's, above the
# 259 symbols that grammars need):
# room for it and a round trip. Two sequences may wait beyond the batch's four: a request of six fills the queue.
MAX_NUM_SEQS, MAX_WAITING, MAX_MODEL_LEN = 4, 2, 2048
FLAGS = ["--skip-server-warmup", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING),
         "--max-num-batched-tokens", "64", "--kv-cache-memory", "16MiB", "--api-key", API_KEY,
         "--served-model-name", MODEL, "--no-ui"]
HELLO = [{"role": "user", "content": "the quick brown fox"}]
# The client no longer has sampling arguments of its own; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}
# Bounded strings and an enum: a random model cannot run on until max_tokens inside the call (about 120 byte-level
# tokens with its forced head and tail).
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "input_schema": {"type": "object",
                     "properties": {"city": {"type": "string", "maxLength": 8},
                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                     "required": ["city", "unit"]},
}


def prompt_length(usage: anthropic.types.Usage) -> int:
    """The prompt's length, as Anthropic splits it: computed, written to the cache, and read from it."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("anthropic") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=2048), seed=5, chat_template=CHATML)
    home = home_with_built_kernels(tmp_path_factory.mktemp("home"))
    proc = start_server("--model", str(folder), *FLAGS, env={"SLUICE_HOME": str(home)})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_create_returns_a_message_with_text_usage_and_a_stop_reason(client):
    message = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                                     system=[{"type": "text", "text": "Be brief."}])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] in ([], ["text"])
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8


def test_a_stream_assembles_to_the_unstreamed_message_at_temperature_0(client):
    kwargs = dict(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY, system="Be brief.")
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    with client.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        snapshot = stream.current_message_snapshot
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert ["".join(b.text for b in m.content) for m in (whole, snapshot)] == ["".join(texts)] * 2
    assert streamed.stop_reason == snapshot.stop_reason == whole.stop_reason
    assert prompt_length(streamed.usage) == prompt_length(whole.usage)
    assert streamed.usage.output_tokens == whole.usage.output_tokens > 0
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_prompt_is_read_from_the_cache_and_input_tokens_count_only_the_rest(client, stream):
    """Anthropic's usage semantics: the prefix cache's share is cache_read_input_tokens, not input_tokens."""
    # Longer than a KV page (64 tokens on a CPU): the cache holds whole pages.
    text = f"streamed: {stream}; " + "the quick brown fox jumps over the lazy dog " * 3
    messages = [{"role": "user", "content": text}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    kwargs = dict(model=MODEL, max_tokens=2, messages=messages, **GREEDY)
    client.messages.create(**kwargs)
    if stream:
        with client.messages.stream(**kwargs) as events:
            usage = events.get_final_message().usage
    else:
        usage = client.messages.create(**kwargs).usage
    assert 0 < usage.cache_read_input_tokens < counted and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == counted


class Weather(BaseModel):
    # No strings: the client's schema transform drops maxLength, and a random model would write one on to
    # max_tokens.
    unit: Literal["celsius", "fahrenheit"]
    sunny: bool


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output_gives_text_the_clients_parse_into_the_schemas_object(client, stream):
    """`output_config.format` (what `messages.parse(output_format=...)` sends): the reply's text is JSON of the
    schema, whatever the weights."""
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=120, messages=HELLO, output_format=Weather,
                                    **GREEDY) as replay:
            message = replay.get_final_message()
    else:
        message = client.messages.parse(model=MODEL, max_tokens=120, messages=HELLO, output_format=Weather, **GREEDY)
    assert isinstance(message.parsed_output, Weather) and message.stop_reason == "end_turn"


def test_structured_output_after_a_prefill_is_a_400_as_on_anthropics_api(client):
    """The grammar would hold only the continuation to the schema: after `{"unit": "`, a whole object again."""
    prefill = [*HELLO, {"role": "assistant", "content": '{"unit": "'}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.parse(model=MODEL, max_tokens=120, messages=prefill, output_format=Weather, **GREEDY)
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("output_config.format cannot be combined with a prefill")


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])
def test_structured_output_with_a_forced_tool_choice_is_a_400_in_the_requests_own_terms(client, tool_choice):
    """The chat field it becomes (response_format) is not one an Anthropic client sent."""
    output_config = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, tools=[WEATHER], tool_choice=tool_choice,
                               extra_body={"output_config": output_config})
    message = caught.value.body["error"]["message"]
    assert message.startswith("output_config.format") and "response_format" not in message


def test_an_output_format_whose_schema_does_not_compile_is_a_400_naming_it_in_the_requests_own_terms(client):
    output_config = {"format": {"type": "json_schema", "schema": {"type": "strin"}}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body={"output_config": output_config})
    error = caught.value.body["error"]
    assert error["message"].startswith("output_config.format.schema: invalid JSON schema"), error
    assert error["details"] == {"error_code": "invalid_json_schema"}


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}],
                         ids=["enabled", "adaptive"])
@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])
def test_thinking_with_a_forced_tool_choice_is_a_400_in_anthropics_words(client, thinking, tool_choice):
    """Anthropic takes thinking with tool_choice auto or none alone: a forced call starts the reply."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=2048, messages=HELLO, tools=[WEATHER], thinking=thinking,
                               tool_choice=tool_choice)
    assert caught.value.body["error"] == {"type": "invalid_request_error",
                                          "message": "Thinking may not be enabled when tool_choice forces tool use."}


@pytest.mark.parametrize(("thinking", "tool_choice"), [
    ({"type": "disabled"}, {"type": "any"}),
    ({"type": "enabled", "budget_tokens": 1024}, {"type": "auto"}),
    ({"type": "adaptive"}, {"type": "none"}),
], ids=["disabled-any", "enabled-auto", "adaptive-none"])
def test_thinking_goes_with_a_tool_choice_that_forces_no_call(thinking, tool_choice):
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 2048, "messages": HELLO, "tools": [WEATHER],
                                           "thinking": thinking, "tool_choice": tool_choice})
    assert chat_request(body).chat_template_kwargs == {"enable_thinking": thinking["type"] != "disabled"}


def test_top_p_0_keeps_the_most_probable_token_alone(client):
    """Anthropic takes top_p from 0 to 1 (chat, above 0): the nucleus of no mass is the most probable token."""
    greedy = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY)
    nucleus = client.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body={"top_p": 0})
    assert [block.text for block in nucleus.content] == [block.text for block in greedy.content]


def test_a_stop_sequence_is_named_as_the_stop_reason(client):
    free = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, **GREEDY)
    text = free.content[0].text
    stop = next(char for char in text[1:] if char.isascii() and char.isalnum())  # whole characters of the output
    message = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, **GREEDY,
                                     stop_sequences=["never there", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in "".join(block.text for block in message.content)


def test_a_streamed_reply_pings_after_its_start_and_names_its_stop_sequence_in_the_message_delta(server, client):
    text = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, **GREEDY).content[0].text
    stop = next(char for char in text[1:] if char.isascii() and char.isalnum())
    body = {"model": MODEL, "max_tokens": 16, "messages": HELLO, "temperature": 0, "stream": True,
            "stop_sequences": [stop]}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=120)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [event["type"] for event in events[:2]] == ["message_start", "ping"]  # the client skips pings
    [delta] = [event for event in events if event["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO, stop_sequences=[stop], **GREEDY) as s:
        assert s.get_final_message().stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_gives_a_valid_tool_use_and_a_tool_result_continues(client, stream):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    request = dict(model=MODEL, max_tokens=200, tools=[WEATHER], messages=question, **GREEDY,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**request) as events:
            first = events.get_final_message()
    else:
        first = client.messages.create(**request)
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}
    conversation = [*question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    reply = client.messages.create(**{**request, "tool_choice": {"type": "auto"}, "max_tokens": 6,
                                      "messages": conversation})
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert prompt_length(reply.usage) > prompt_length(first.usage) + first.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_stops_for_max_tokens(client, stream):
    request = dict(model=MODEL, max_tokens=30, tools=[WEATHER], messages=HELLO, tool_choice={"type": "any"})
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 30


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_window_stops_the_reply_where_the_window_ends(client, stream):
    """As Anthropic's API takes it (stop_reason model_context_window_exceeded): a max_tokens the context cannot
    hold after the prompt (agents ask for 32000) asks for as much as it holds, not a 400. A forced call cannot end
    before the window does."""
    forced = dict(model=MODEL, tools=[WEATHER], tool_choice={"type": "any"})

    def count(text: str) -> int:  # a token per "x" of the text
        return client.messages.count_tokens(**forced, messages=[{"role": "user", "content": text}]).input_tokens

    messages = [{"role": "user", "content": "x" * (MAX_MODEL_LEN - count("x") - 39)}]
    room = MAX_MODEL_LEN - count(messages[0]["content"])
    assert 0 < room <= 40  # less than the call takes
    if stream:
        with client.messages.stream(**forced, messages=messages, max_tokens=32000) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**forced, messages=messages, max_tokens=32000)
    assert message.stop_reason == "model_context_window_exceeded" and message.usage.output_tokens == room


@pytest.mark.parametrize("past", [0, 1], ids=["filling the window", "past it"])
def test_a_prompt_that_leaves_the_reply_no_room_is_anthropics_prompt_is_too_long(client, past):
    """In Anthropic's words, which clients match to tell an overflow from other 400s (pydantic-ai's
    ModelContextWindowExceededError, LangChain's ContextOverflowError): the most a prompt may hold is the window
    less the reply's first token (the model card's max_input_tokens)."""
    def count(text: str) -> int:  # a token per "x" of the text
        return client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": text}]).input_tokens

    text = "x" * (MAX_MODEL_LEN - count("x") + 1 + past)
    assert count(text) == MAX_MODEL_LEN + past
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": text}])
    assert caught.value.body["error"] == {
        "type": "invalid_request_error", "details": {"error_code": "context_length_exceeded"},
        "message": f"prompt is too long: {MAX_MODEL_LEN + past} tokens > {MAX_MODEL_LEN - 1} maximum"}


def test_a_call_cut_by_max_tokens_has_the_parameters_it_completed_whole_as_streamed(client):
    """As Anthropic streams a call's input, one whole parameter at a time (a value cut by max_tokens never reaches
    the stream): cut short, a call's input is the parameters it completed, in the message and in the client's
    assembly of the stream alike (the message gave `{}`, while the client assembled the fragments, a value cut in the
    middle among them, into more)."""
    request = dict(model=MODEL, tools=[WEATHER], messages=HELLO, tool_choice={"type": "any"}, **GREEDY)
    complete = client.messages.create(**request, max_tokens=200)
    [call] = complete.content
    assert complete.stop_reason == "tool_use" and set(call.input) == {"city", "unit"}
    inputs, sent = [], {}
    # Cut everywhere from the call's head on: in its name, its city, between the two, its unit, after its object.
    for max_tokens in range(complete.usage.output_tokens - 50, complete.usage.output_tokens):
        whole = client.messages.create(**request, max_tokens=max_tokens)
        with client.messages.stream(**request, max_tokens=max_tokens) as events:
            fragments = [event.partial_json for event in events if event.type == "input_json"]
            streamed = events.get_final_message()
        assert whole.stop_reason == streamed.stop_reason == "max_tokens"
        whole_inputs = [block.input for block in whole.content if block.type == "tool_use"]
        assert whole_inputs == [block.input for block in streamed.content if block.type == "tool_use"], max_tokens
        for i in range(1, len(fragments) + 1):  # what has gone out is always whole members of an object
            members = "".join(fragments[:i])
            assert isinstance(json.loads(members if members.endswith("}") else members + "}"), dict)
        if whole_inputs:  # and the block's fragments join to its input's JSON, closed where the call was cut
            assert json.loads("".join(fragments)) == whole_inputs[0], max_tokens
        inputs += whole_inputs
        sent[max_tokens] = "".join(fragments)
    assert all(cut == {name: call.input[name] for name in cut} for cut in inputs)  # no value cut short
    assert {} in inputs and {"city": call.input["city"]} in inputs and call.input in inputs
    # A tool asking for eager_input_streaming has its input streamed as sampled: the unit cut short goes out too.
    last_without_unit = max(max_tokens for max_tokens, members in sent.items() if '"unit"' not in members)
    eager = {**request, "tools": [{**WEATHER, "eager_input_streaming": True}]}
    with client.messages.stream(**eager, max_tokens=last_without_unit) as events:
        streamed = "".join(event.partial_json for event in events if event.type == "input_json")
    assert streamed.startswith(sent[last_without_unit].removesuffix("}")) and '"unit": "' in streamed


def test_a_named_tool_choice_calls_that_tool(client):
    other = {**WEATHER, "name": "get_time"}
    message = client.messages.create(model=MODEL, max_tokens=200, tools=[other, WEATHER], **GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"}, messages=HELLO)
    assert [block.name for block in message.content if block.type == "tool_use"] == ["get_weather"]


def test_blocks_become_the_chat_messages_they_mean():
    body = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "down"}]},
                                         {"type": "text", "text": "And?"}]},
        ]})
    chat = chat_request(body)
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Looking."), ("tool", "Error: down"),
        ("user", "And?")]
    [call] = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                   {"city": "Oslo"})
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.tool_choice == "required" and not chat.parallel_tool_calls and chat.stop == ["END"]


def test_a_strict_tool_under_auto_holds_the_calls_the_model_chooses_as_a_chat_request_s_does():
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "?"}],
                                           "tools": [{**WEATHER, "strict": True}]})
    assert chat_request(body).tools[0].function.strict and chat_request(body).holds_chosen_calls()
    body = MessagesRequest.model_validate({**body.model_dump(exclude_none=True), "tools": [WEATHER]})
    assert not chat_request(body).holds_chosen_calls()


THOUGHT = {"type": "thinking", "thinking": "A fox.", "signature": "sig"}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}


def test_thinking_blocks_are_the_assistant_messages_reasoning_and_redacted_thinking_is_left_out():
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": [
        *HELLO,
        {"role": "assistant", "content": [THOUGHT, {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "thinking", "thinking": "It jumps.", "signature": "sig"},
                                          {"type": "text", "text": "Over the dog."}]},
        {"role": "user", "content": "And then?"}]})
    assistant = chat_request(body).messages[1]
    assert (assistant.text(), assistant.reasoning_content) == ("Over the dog.", "A fox.\nIt jumps.")


@pytest.mark.parametrize("block", [THOUGHT, {"type": "redacted_thinking", "data": "opaque"}])
def test_thinking_blocks_belong_in_assistant_messages(block):
    with pytest.raises(ValidationError, match="thinking blocks belong in assistant messages"):
        MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": [block]}]})


@pytest.mark.parametrize(("fields", "kwargs", "effort"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"enable_thinking": True}, None),
    ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, {"enable_thinking": True}, "low"),
    ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}, None),
    ({"output_config": {"effort": "max"}}, {}, "max"),
    ({}, {}, None),
], ids=["enabled", "adaptive", "disabled", "effort alone", "neither"])
def test_thinking_is_the_templates_enable_thinking_and_the_effort_its_reasoning_effort(fields, kwargs, effort):
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 2048, "messages": HELLO, **fields})
    chat = chat_request(body)
    assert (chat.chat_template_kwargs, chat.reasoning_effort) == (kwargs, effort)
    assert chat.thinking_token_budget is None  # the server holds no reply to a budget (`budgets` False)
    budget = fields.get("thinking", {}).get("budget_tokens")
    assert chat_request(body, budgets=True).thinking_token_budget == budget


@pytest.mark.parametrize("empty", ["", [], [THOUGHT]])
def test_an_empty_final_assistant_message_is_no_prefill(empty):
    """Anthropic allows the final assistant message, alone of all, to be empty: the reply then starts afresh (it
    was a 400 naming continue_final_message, a field the request never had). A text block in it has text all the
    same (`test_bad_requests_...`)."""
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4,
                                           "messages": [*HELLO, {"role": "assistant", "content": empty}]})
    chat = chat_request(body)
    assert [(m.role, m.text()) for m in chat.messages] == [("user", "the quick brown fox")]
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_count_tokens_counts_the_prompt_that_create_renders(client):
    kwargs = dict(model=MODEL, messages=HELLO, system="Be brief.", tools=[WEATHER])
    counted = client.messages.count_tokens(**kwargs).input_tokens
    assert counted == prompt_length(client.messages.create(**kwargs, max_tokens=1).usage)
    assert counted > client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens


def test_a_final_assistant_message_is_the_start_of_the_reply(server, client):
    prefill = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Sure,"}]}]
    # CHATML's rendering of HELLO, its generation prompt, then the prefill: no end of turn after it.
    continued = "<s>user\nthe quick brown fox</s>\n<s>assistant\nSure,"
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": continued}, headers={"x-api-key": API_KEY})
    assert client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens == tokenized.json()["count"]
    message = client.messages.create(model=MODEL, max_tokens=4, messages=prefill)
    assert prompt_length(message.usage) == tokenized.json()["count"]


def test_consecutive_messages_of_one_role_are_one_turn(client):
    def count(messages: list[dict]) -> int:
        return client.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    first, second = {"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox"}
    assert count([{"role": "user", "content": "the quick"}, {"role": "user", "content": [second]}]) == count(
        [{"role": "user", "content": [first, second]}])


def test_the_key_is_accepted_in_x_api_key_and_as_a_bearer_token(server):
    body = {"model": MODEL, "messages": HELLO}
    url = f"{server.url}/v1/messages/count_tokens"
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("fields", "words"), [
    ({"messages": HELLO}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": -5}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "launch"}},
     "tool_choice names 'launch', which is not among the tools"),
    *[({"messages": HELLO, "max_tokens": 4, "tool_choice": choice},
       "tool_choice: tool_choice may only be specified while providing tools.")
      for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"})],
    ({"messages": HELLO, "max_tokens": 4,
      "tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"type": "banana"}}}}]},
     "tools.0.input_schema: invalid JSON schema"),
    ({"messages": HELLO, "max_tokens": 4, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]},
     "tools.0.input_schema: the schema's type must be 'object': a tool_use block's input is an object"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     "messages.0: content.0: 'image' blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                 "content": [{"type": "document", "source": {}}]}]}],
      "max_tokens": 4}, "messages.0: content.0.content.0: 'document' blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 4},
     "messages.0.content.0.text: Field required"),
    ({"messages": HELLO, "max_tokens": 4, "system": [{"type": "text", "txt": "Be brief."}]},
     "system.0.text: Field required"),
    ({"messages": HELLO, "max_tokens": 4, "stop_sequences": ["END", ""]},
     "stop_sequences: each stop sequence must contain non-whitespace"),
    ({"messages": HELLO, "max_tokens": 4, "stop_sequences": ["\n"]},
     "stop_sequences: each stop sequence must contain non-whitespace"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}], "max_tokens": 4},
     "messages: text content blocks must be non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " \n"}]}],
      "max_tokens": 4}, "messages: text content blocks must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": "  "}], "max_tokens": 4},
     "messages: text content blocks must contain non-whitespace text"),
    # An agent's history where a reply went straight to its call with an empty text block before it.
    ({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": ""}, {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}],
      "max_tokens": 4}, "messages: text content blocks must be non-empty"),
    ({"messages": HELLO, "max_tokens": 4,
      "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""}]},
     "system: text content blocks must be non-empty"),
    ({"messages": HELLO, "max_tokens": 4, "system": [{"type": "text", "text": "\t"}]},
     "system: text content blocks must contain non-whitespace text"),
    ({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": ""}]}], "max_tokens": 4},
     "messages: text content blocks must be non-empty"),
    ({"messages": [*HELLO, {"role": "assistant", "content": " "}], "max_tokens": 4},
     "messages: text content blocks must contain non-whitespace text"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Sure, "}], "max_tokens": 4},
     "messages: final assistant content cannot end with trailing whitespace"),
    ({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Sure,"},
                                                             {"type": "text", "text": "here:\n"}]}], "max_tokens": 4},
     "messages: final assistant content cannot end with trailing whitespace"),
    ({"messages": HELLO, "max_tokens": 4, "temperature": 1.5}, "temperature"),
    ({"messages": HELLO, "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"messages": HELLO, "max_tokens": 4, "top_k": -1}, "top_k"),
    ({"messages": HELLO, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1023}},
     "thinking.budget_tokens"),
    ({"messages": HELLO, "max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "max_tokens must be greater than thinking.budget_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 4},
     "messages.0: all messages must have non-empty content except for the optional final assistant message"),
    ({"messages": [*HELLO, {"role": "assistant", "content": ""}, {"role": "user", "content": "And?"}],
      "max_tokens": 4}, "messages.1: all messages must have non-empty content except for the optional final"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}], "max_tokens": 4},
     "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9."),
    ({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                              "input": {}}]},
                   {"role": "user", "content": "And?"}], "max_tokens": 4},
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1."),
    # Text before the result (in its message, or a message before it in the turn) would come between the call and
    # its result: Anthropic answers the call only with the results that open the next turn.
    *[({"messages": [*HELLO, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                                "input": {}}]}, *turn], "max_tokens": 4},
       "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1.")
      for turn in ([{"role": "user", "content": [{"type": "text", "text": "Here:"}, TOOL_RESULT]}],
                   [{"role": "user", "content": "Here:"}, {"role": "user", "content": [TOOL_RESULT]}])],
])
def test_bad_requests_are_400_invalid_request_errors_in_anthropics_shape(server, fields, words):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **fields}, headers={"x-api-key": API_KEY})
    body = response.json()
    assert response.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"]


@pytest.mark.parametrize(("tool", "words"), [
    ({"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
     "tools.1: 'web_search_20250305' tools (web_search) are not supported"),
    ({"type": "bash_20250124", "name": "bash"}, "tools.1: 'bash_20250124' tools (bash) are not supported"),
    ({"type": "mcp_toolset", "mcp_server_name": "docs"}, "tools.1: 'mcp_toolset' tools are not supported"),
], ids=["server tool", "anthropic-defined client tool", "mcp toolset"])
def test_a_tool_of_a_kind_sluice_cannot_run_is_a_400_naming_it(client, tool, words):
    """Sluice runs custom tools alone (an input_schema, called by the model, answered by the client): a server tool
    or an Anthropic-defined one is refused by its type, not as a type that should have been 'custom'."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.beta.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[WEATHER, tool])
    message = caught.value.body["error"]["message"]
    assert message.startswith(words) and "only custom tools" in message


def test_remote_mcp_servers_are_a_400_naming_them(client):
    server = {"type": "url", "url": "https://mcp.example/sse", "name": "docs"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.beta.messages.create(model=MODEL, max_tokens=4, messages=HELLO, mcp_servers=[server])
    assert caught.value.body["error"]["message"].startswith("mcp_servers: remote MCP servers (docs) are not supported")


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "launch"}},
     "tool_choice: tool_choice names 'launch', which is not among the tools"),
    ({"max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "max_tokens must be greater than thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]},
     "messages.0: tool_use blocks belong in assistant messages"),
    ({"messages": [*HELLO, {"role": "assistant", "content": [THOUGHT]}, {"role": "user", "content": [THOUGHT]}]},
     "messages.2: thinking blocks belong in assistant messages"),
], ids=["tool_choice", "budget", "tool_use", "thinking"])
def test_sluices_own_checks_are_said_in_their_words_alone(client, fields, words):
    """Without pydantic's "Value error, " before them, as Anthropic's checks are said."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": HELLO, **fields})
    assert caught.value.body["error"]["message"] == words


def test_count_tokens_refuses_text_blocks_without_text_as_create_does(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL,
                                     messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}])
    assert caught.value.body["error"]["message"] == "messages: text content blocks must be non-empty"


def test_a_prefill_may_end_in_whitespace_before_the_final_turn(client):
    """Only the final assistant content is held to no trailing whitespace: an earlier reply may end in some."""
    messages = [*HELLO, {"role": "assistant", "content": "Sure. "}, {"role": "user", "content": "And?"}]
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens > 0


def test_a_full_queue_is_anthropics_overload_a_529_with_retry_after_and_a_429_on_the_openai_routes(server, client):
    """Anthropic answers an overloaded API with 529 overloaded_error, which the client raises as OverloadedError (and
    retries, after Retry-After); 429 rate_limit_error (RateLimitError) is an account's own rate limit, which a full
    queue is not. The OpenAI routes keep their 429."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # A request of as many sequences as the batch and the queue hold, generating for seconds (until aborted).
    hold = {"model": MODEL, "messages": HELLO, "n": MAX_NUM_SEQS + MAX_WAITING, "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=hold, headers=headers, timeout=120) as held:
        assert held.status_code == 200  # admitted: the queue is full
        with pytest.raises(anthropic.OverloadedError) as caught:
            client.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
        with pytest.raises(anthropic.OverloadedError):
            with client.messages.stream(model=MODEL, max_tokens=4, messages=HELLO) as events:
                events.get_final_message()
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                          json={"model": MODEL, "messages": HELLO, "max_tokens": 4})
    assert caught.value.status_code == 529 and caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body == {"type": "error", "error": {
        "type": "overloaded_error", "message": "The server's waiting queue is full; retry later",
        "details": {"error_code": "queue_full"}}}
    assert chat.status_code == 429 and chat.headers["retry-after"] == "1"
    assert chat.json()["error"]["type"] == "rate_limit_error"
    # The held request was aborted as its connection closed; its sequences leave the queue at the next step.
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=10) as retrying:
        assert retrying.messages.create(model=MODEL, max_tokens=1, messages=HELLO).usage.output_tokens == 1


@pytest.mark.parametrize(("error", "status", "kind"), [(queue_full(3), 529, "overloaded_error"),
                                                       (not_ready("The model is still loading"), 503, "api_error")])
def test_overload_and_unavailability_in_anthropics_terms(error, status, kind):
    """A full queue is Anthropic's overload (its Retry-After kept); Sluice's 503s keep their status, which proxies
    read, as api_error: Anthropic pairs overloaded_error with 529 alone."""
    response = error_response_for({"type": "http", "path": "/v1/messages", "headers": []}, error)
    assert (response.status_code, json.loads(response.body)["error"]["type"]) == (status, kind)
    assert response.headers.get("retry-after") == error.headers.get("Retry-After")
    chat = {"type": "http", "path": "/v1/chat/completions", "headers": []}
    assert error_response_for(chat, error).status_code == error.status


def test_a_body_over_the_limit_is_anthropics_413_request_too_large(client):
    with pytest.raises(anthropic.ContentTooLargeError) as caught:  # past --max-body-bytes (4 MiB by default)
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert caught.value.body["error"]["type"] == "request_too_large"


def test_an_unknown_model_is_a_404_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-elsewhere", max_tokens=4, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_message_batches_which_sluice_does_not_serve_are_a_404_in_anthropics_shape(client):
    """A route of Anthropic's Messages API that Sluice lacks answers as Anthropic's routes do (it was the OpenAI
    routes' 404 body, whose error type, invalid_request_error, is not Anthropic's for a 404)."""
    request = {"custom_id": "a", "params": {"model": MODEL, "max_tokens": 4, "messages": HELLO}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.batches.create(requests=[request])
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                            "message": "Invalid URL (POST /v1/messages/batches)"}}


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_tool_runner_runs_its_loop_sending_whole_histories(client, stream):
    # The runner asks for a message thread first; refused as a thread it cannot hold, it sends whole histories.
    asked = []

    def get_weather(city: str, unit: str) -> str:
        asked.append(city)
        return f"18 degrees {unit} in {city}"

    tool = anthropic.beta_tool(get_weather, description=WEATHER["description"], input_schema=WEATHER["input_schema"])
    runner = client.beta.messages.tool_runner(
        model=MODEL, max_tokens=200, tools=[tool], messages=[{"role": "user", "content": "Weather in Paris?"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_iterations=2, stream=stream, **GREEDY)
    replies = [(turn.get_final_message() if stream else turn) for turn in runner]
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"] and len(asked) == 2
    # The second reply's prompt held the first turn: its call and the tool's result.
    assert prompt_length(replies[1].usage) > prompt_length(replies[0].usage) + replies[0].usage.output_tokens


def test_a_message_thread_is_refused_as_one_the_client_can_go_on_without(server):
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": MODEL, "max_tokens": 4, "messages": HELLO, "thread": {"type": "create"}})
    assert response.status_code == 400
    assert response.json()["error"]["details"] == {"error_code": "thread_unsupported_request"}


class _Replay:
    """A generation that replays `texts` as increments of one token each (what `MessageBuilder` reads), the last
    one with a "stop" finish and `stop_reason`."""

    def __init__(self, texts: list[str], stop_reason: str | int | None = None) -> None:
        self._texts = texts
        self._stop_reason = stop_reason
        self.usage = Usage(prompt_tokens=3, completion_tokens=len(texts))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for i, text in enumerate(self._texts):
            last = i == len(self._texts) - 1
            yield Increment(0, text, (i,), finish_reason="stop" if last else None,
                            stop_reason=self._stop_reason if last else None)


@pytest.mark.parametrize("stop_reason, expected", [("<|im_end|>", ("stop_sequence", "<|im_end|>")),
                                                   (None, ("end_turn", None))])
def test_the_stop_sequence_is_the_one_the_engine_stopped_on_even_if_its_text_is_not_in_the_output(stop_reason,
                                                                                                  expected):
    """The engine names the stop string that ended a choice; a special token's text, left out of the decoded
    output, is named all the same."""
    async def streamed() -> dict:
        events = [json.loads(event.split(b"data: ")[1]) async for event in builder().events(replay)]
        return next(event for event in events if event["type"] == "message_delta")["delta"]

    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, None)

    replay = _Replay(["Hello", " there"], stop_reason)
    whole = asyncio.run(builder().collect(replay))
    assert (whole.stop_reason, whole.stop_sequence) == expected
    assert asyncio.run(streamed()) == dict(zip(("stop_reason", "stop_sequence"), expected))


def test_message_start_counts_the_whole_prompt_as_input_and_message_delta_splits_off_the_cached_part():
    """The engine reports the prefix cache's share when the reply ends, after message_start went out."""
    replay = _Replay(["Hi"])
    replay.usage = Usage(prompt_tokens=3, completion_tokens=1, cached_prompt_tokens=2)

    async def stream() -> list[dict]:
        return [json.loads(event.split(b"data: ")[1])
                async for event in MessageBuilder("msg_1", MODEL, 3, None).events(replay)]

    events = {event["type"]: event for event in asyncio.run(stream())}
    split = {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2}
    assert events["message_start"]["message"]["usage"] == {**split, "input_tokens": 3, "output_tokens": 0,
                                                           "cache_read_input_tokens": 0}
    assert events["message_delta"]["usage"] == split


def test_text_after_a_call_is_a_block_after_it_whole_as_streamed():
    texts = ["Checking.", "\n<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
             "\n</tool_call>\n", "Done."]

    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, ToolCalling(frozenset({"get_weather"})))

    async def stream() -> list[dict]:
        return [json.loads(event.split(b"data: ")[1]) async for event in builder().events(_Replay(texts))]

    whole = asyncio.run(builder().collect(_Replay(texts)))

    streamed: dict[int, tuple[str, str]] = {}
    for event in asyncio.run(stream()):
        if event["type"] == "content_block_start":
            streamed[event["index"]] = (event["content_block"]["type"], "")
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            streamed[event["index"]] = ("text", streamed[event["index"]][1] + event["delta"]["text"])
    blocks = [("text", "Checking."), ("tool_use", ""), ("text", "Done.")]
    assert list(streamed.values()) == blocks
    assert [(block.type, getattr(block, "text", "")) for block in whole.content] == blocks
    assert whole.content[1].input == {"city": "Oslo"} and whole.stop_reason == "tool_use"


def test_a_lone_surrogate_escape_in_a_calls_arguments_is_a_replacement_character_not_a_500():
    """A model may escape half a surrogate pair (`\\ud83d`): decoded into the tool_use's input, no UTF-8 reply
    could carry it, and the whole message did not serialize."""
    texts = ["\n<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "\\ud83d Oslo \\ud83d\\ude00"}}',
             "\n</tool_call>\n"]
    whole = asyncio.run(MessageBuilder("msg_1", MODEL, 3, ToolCalling(frozenset({"get_weather"})))
                        .collect(_Replay(texts)))
    assert json.loads(whole.model_dump_json())["content"][0]["input"] == {"city": "\ufffd Oslo \U0001f600"}


class _Broken(_Replay):
    """A generation whose reading fails after its texts, as a bug would (not an engine error)."""

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for i, text in enumerate(self._texts):
            yield Increment(0, text, (i,))
        raise RuntimeError("a bug")


def test_a_bug_mid_stream_ends_the_stream_with_an_api_error_event():
    async def stream() -> list[dict]:
        builder = MessageBuilder("msg_1", MODEL, 3, None)
        return [json.loads(event.split(b"data: ")[1]) async for event in builder.events(_Broken(["Hi"]))]

    events = asyncio.run(stream())
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}
    assert any(e["type"] == "content_block_delta" for e in events)


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"city": "Oslo", "days": 12', {"city": "Oslo"}),  # 12 may be the start of 123
    ('{"city": "Oslo", "where": {"lat": 59.9, "lon": 10', {"city": "Oslo"}),
    ('{"city": "Os', {}),
    ('{"city": "Oslo", "days": 12}}', {"city": "Oslo", "days": 12}),  # the call's object closed
], ids=["a number", "an object", "the first value", "none"])
def test_a_forced_call_cut_short_holds_back_the_value_being_written_whole_as_streamed(arguments, expected):
    """The value being written when max_tokens cut the call is no parameter yet: the anthropic client would parse a
    streamed `12` as 12, a nested object as the members it had."""
    texts = list('<tool_call>\n{"name": "get_weather", "arguments": ' + arguments)  # a token per character

    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, ToolCalling(frozenset({"get_weather"}), forced=True))

    async def stream() -> list[dict]:
        return [json.loads(event.split(b"data: ")[1]) async for event in builder().events(_Replay(texts))]

    whole = asyncio.run(builder().collect(_Replay(texts)))
    sent = "".join(event["delta"]["partial_json"] for event in asyncio.run(stream())
                   if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta")
    assert whole.content[0].input == expected == (from_json(sent.encode(), partial_mode=True) if sent else {})


def test_an_eager_tools_call_streams_its_input_as_it_is_sampled_and_its_message_holds_whole_parameters():
    texts = list('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 12')

    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, ToolCalling(frozenset({"get_weather"}), forced=True),
                              eager=frozenset({"get_weather"}))

    async def stream() -> list[dict]:
        return [json.loads(event.split(b"data: ")[1]) async for event in builder().events(_Replay(texts))]

    deltas = [event["delta"]["partial_json"] for event in asyncio.run(stream())
              if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta"]
    assert len(deltas) > 2 and "".join(deltas) == '{"city": "Oslo", "days": 12'
    assert asyncio.run(builder().collect(_Replay(texts))).content[0].input == {"city": "Oslo"}


_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(("text", "forced", "stop", "expected"), [
    (_CALL[:_CALL.index("Paris")], True, "Paris", ("stop_sequence", "Paris")),
    (_CALL + "\n</tool_call>\nThought: wait for it.\n", False, "Observation:", ("tool_use", None)),
    (_CALL + "\n", False, "</tool_call>", ("tool_use", None)),
], ids=["inside-a-call", "after-a-call", "at-a-calls-close"])
def test_a_stop_sequence_is_the_stop_reason_only_where_it_cut_a_call_short_whole_as_streamed(text, forced, stop,
                                                                                            expected):
    """A stop sequence written inside a call's input ends the reply with the call unfinished: the reply stopped
    for the stop sequence, not for a call the client could run (as a call max_tokens cuts stops for max_tokens).
    One after complete calls (a ReAct "Observation:", or the call's close) leaves them to run: the reply stopped
    for them, `tool_use`, as vLLM's chat reply stops for `tool_calls`, and its `stop_sequence` is null (Anthropic
    names one only with a `stop_sequence` stop reason)."""
    texts = list(text)  # a token per character

    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, ToolCalling(frozenset({"get_weather"}), forced=forced))

    async def stream() -> dict:
        events = [json.loads(event.split(b"data: ")[1]) async for event in builder().events(_Replay(texts, stop))]
        return next(event for event in events if event["type"] == "message_delta")["delta"]

    whole = asyncio.run(builder().collect(_Replay(texts, stop)))
    assert (whole.stop_reason, whole.stop_sequence) == expected
    assert asyncio.run(stream()) == dict(zip(("stop_reason", "stop_sequence"), expected))


@pytest.mark.parametrize(("texts", "expected"), [
    ([" "], []),  # as a prefill "1," continued up to the stop sequence "2"
    (["\n\n", " "], []),
    (["  ", "Hi"], [("text", "  Hi")]),
], ids=["a space", "whitespace in tokens", "whitespace before text"])
def test_a_reply_has_no_text_block_of_whitespace_alone_whole_as_streamed(texts, expected):
    """Anthropic refuses a text block of whitespace alone in a request, so a reply holding one could not be sent
    back in the conversation (`message.to_param()`): such text is no block, as Anthropic's replies have none."""
    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 3, None)

    async def stream() -> list[dict]:
        return [json.loads(event.split(b"data: ")[1]) async for event in builder().events(_Replay(texts))]

    def shape(block: dict) -> tuple[str, str]:
        return block["type"], block["text"]

    whole = asyncio.run(builder().collect(_Replay(texts)))
    streamed: dict[int, dict] = {}
    for event in asyncio.run(stream()):
        if event["type"] == "content_block_start":
            streamed[event["index"]] = event["content_block"]
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            streamed[event["index"]]["text"] += event["delta"]["text"]
    assert [shape(block.model_dump()) for block in whole.content] == expected
    assert [shape(block) for block in streamed.values()] == expected


def test_the_anthropic_client_lists_and_retrieves_the_served_model(client):
    """Anthropic's models list: `type`, `display_name` and `created_at` (the client's ModelInfo), one page."""
    page = client.models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [(MODEL, "model", MODEL)]
    assert not page.has_more and page.first_id == page.last_id == MODEL
    info = client.models.retrieve(MODEL)
    assert info.id == MODEL and info.created_at.tzinfo is not None and info.created_at.year >= 2026
    assert info.lifecycle == "active"  # a field the client's ModelInfo requires
    assert info.max_input_tokens == info.max_tokens == info.max_model_len - 1  # the context, less a reply's token


def test_the_openai_client_reads_the_same_models_list_and_card(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        assert [(m.id, m.object, m.owned_by) for m in client.models.list().data] == [(MODEL, "model", "sluice")]
        card = client.models.retrieve(MODEL)
        assert (card.id, card.object) == (MODEL, "model") and card.created > 1_700_000_000


def test_an_unknown_model_id_is_a_404_in_the_shape_of_the_client_that_asked(server, client):
    """The anthropic client sends `anthropic-version` on every request: it gets Anthropic's error and `request-id`;
    the openai client, on the same path, OpenAI's (both have an `error.type`, each its own, so one body cannot
    carry both)."""
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("claude-elsewhere")
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert caught.value.response.headers["request-id"] == caught.value.request_id
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as openai_client:
        with pytest.raises(openai.NotFoundError) as refused:
            openai_client.models.retrieve("gpt-elsewhere")
    assert refused.value.body["code"] == "model_not_found" and "request-id" not in refused.value.response.headers
