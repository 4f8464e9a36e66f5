"""Mistral's tool calls end to end: the official `openai` client against a real `sluice serve` with a tiny random
model whose template is Mistral's (`auto` picks the Mistral format) and whose vocabulary holds `[TOOL_CALLS]` as
a special token, whose text such a request keeps (`skip_special_tokens` false) for the reader; `required` and named
choices are forced by the grammar, so calls are valid whatever the weights."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tokenizers import AddedToken

from sluice.model.config import ModelConfig

from hf_folder import train_tokenizer, write_hf_folder
from test_api_e2e import API_KEY, start_server
from test_tool_calls import MISTRAL, reassemble

MODEL = "tiny-mistral"
FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--kv-cache-memory", "16MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui",
         "--tool-call-parser", "auto"]
# Bounded strings and an enum: a random model cannot run on until max_tokens inside a forced call.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
CART = {"type": "function", "function": {"name": "add_to_cart", "description": "Adds items to the cart",
                                         "parameters": {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
                             "maxItems": 3}},
    "required": ["items"]}}}
SCHEMA = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CART)}
ASK = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=2048), seed=7)
    tokenizer = train_tokenizer(287)
    tokenizer.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": MISTRAL}))
    server = start_server("--model", str(folder), *FLAGS, env={"SLUICE_HOME": str(tmp_path_factory.mktemp("home"))})
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.stop()


def test_required_calls_in_the_mistral_format_come_back_valid(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.8, seed=1, n=4, max_tokens=200)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add_to_cart"}},
                                         "auto"])
def test_streamed_mistral_deltas_reassemble_to_the_unstreamed_reply_at_temperature_0(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice=tool_choice,
                  parallel_tool_calls=False, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish, ids = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason and len(ids) == len(calls)
    if tool_choice != "auto":
        assert calls and finish == "tool_calls"


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
