"""Mistral's tool calls end to end: the official `openai` client against a real `sluice serve` with a tiny random
model whose template is Mistral's (`auto` picks the Mistral format) and whose vocabulary holds `[TOOL_CALLS]` as
a special token, whose text such a request keeps (`kept_special_ids`) for the reader; `required` and named
choices are forced by the grammar, so calls are valid whatever the weights."""

from __future__ import annotations

import json

import jsonschema
import pytest

from test_tool_calls import MISTRAL
from tool_call_servers import (ASK, CART, SCHEMA, TOOL_CHOICES, WEATHER, assert_required_calls_come_back_valid,
                               assert_streamed_deltas_reassemble_to_the_unstreamed_reply, reassemble, tiny_model_server)

MODEL = "tiny-mistral"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_model_server(tmp_path_factory, "[TOOL_CALLS]", MISTRAL, "auto", MODEL) as client:
        yield client


def test_required_calls_in_the_mistral_format_come_back_valid(client):
    assert_required_calls_come_back_valid(client, MODEL)


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES)
def test_streamed_mistral_deltas_reassemble_to_the_unstreamed_reply_at_temperature_0(client, tool_choice):
    assert_streamed_deltas_reassemble_to_the_unstreamed_reply(
        client, tool_choice != "auto", model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0, max_tokens=120)


def test_a_round_trip_renders_the_call_and_its_result_through_the_mistral_template(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
    [call] = first.choices[0].message.tool_calls
    assert call.id.startswith("call_")  # the template's nine-character ids are made from it when rendering
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 31})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=4)
    # The prompt grew by the call and its result (a template that refused the ids would have been a 400).
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_a_stop_string_inside_a_forced_call_ends_the_stream_as_it_ends_the_whole_reply(client):
    # The grammar writes `"city"` inside the arguments, so the stop string cuts the call after it has started.
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=120, stop=['"city"'])
    whole = client.chat.completions.create(**kwargs).choices[0]
    _, calls, finish, _ = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", "{")]
    assert finish == whole.finish_reason


def test_under_auto_strict_tools_make_what_follows_the_marker_calls_valid_for_their_schemas(client):
    """The random model writes `[TOOL_CALLS]` now and then. With strict tools the grammar makes what follows it
    calls that follow their schemas (a reply cut by max_tokens inside one excepted: an unfinished call is text
    under auto); without, what follows is noise, read as text."""
    def replies(strict: bool) -> list:
        tools = [{"type": "function", "function": {**tool["function"], "strict": strict}} for tool in (WEATHER, CART)]
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, parallel_tool_calls=False,
                                              temperature=1.0, seed=3, n=16, max_tokens=300).choices

    held = replies(True)
    calls = [call for choice in held for call in choice.message.tool_calls or []]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
    for choice in held:
        assert choice.finish_reason == "length" or "[TOOL_CALLS]" not in (choice.message.content or "")
    assert not any(choice.message.tool_calls for choice in replies(False))


def test_under_auto_a_json_response_format_leaves_the_model_its_calls(client):
    """The grammar takes the answer the format asks for, or calls (of strict tools here, whose arguments follow
    their schemas): the random model writes either."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {**tool["function"], "strict": True}} for tool in (WEATHER, CART)]
    choices = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, parallel_tool_calls=False, temperature=1.0, seed=5, n=16,
        max_tokens=300, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}).choices
    answered = [c for c in choices if c.finish_reason == "stop"]
    called = [c for c in choices if c.finish_reason == "tool_calls"]
    assert answered and called and len(answered) + len(called) + sum(c.finish_reason == "length" for c in choices) == 16
    for choice in answered:
        assert choice.message.tool_calls is None
        jsonschema.validate(json.loads(choice.message.content), answer)
    for choice in called:
        [call] = choice.message.tool_calls
        assert choice.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
