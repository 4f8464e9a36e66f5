"""What the end-to-end tool-call tests share: a real `sluice serve` behind the official `openai` client, of a tiny
random model whose vocabulary holds a format's marker as a special token and whose chat template is the format's;
the tools they offer it, and a streamed reply read back into its content and calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import jsonschema
import openai
import pytest

from hf_folder import train_tokenizer_with_special_tokens, write_hf_folder
from sluice.model.config import ModelConfig
from test_api_e2e import API_KEY, start_server

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
TOOL_CHOICES = ["required", {"type": "function", "function": {"name": "add_to_cart"}}, "auto"]


@contextmanager
def openai_client(*flags: str, env: dict[str, str] | None = None) -> Iterator[openai.OpenAI]:
    """The `openai` client of a `sluice serve` started with `flags` (an `--api-key` of API_KEY among them), stopped
    on leaving."""
    server = start_server(*flags, env=env)
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
            yield client
    finally:
        server.stop()


@contextmanager
def tiny_model_server(tmp_path_factory: pytest.TempPathFactory, marker: str, chat_template: str, parser: str,
                      model: str, *other_special: str) -> Iterator[openai.OpenAI]:
    """`openai_client` of a tiny random model (vocabulary 288 whose last tokens are `marker` then `other_special`,
    special tokens; context 2048) with `chat_template`, served as `model` with `--tool-call-parser parser`."""
    folder = tmp_path_factory.mktemp(model) / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=2048), seed=7,
                    chat_template=chat_template)
    train_tokenizer_with_special_tokens(marker, *other_special).save(str(folder / "tokenizer.json"))
    flags = ["--model", str(folder), "--max-model-len", "2048", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "64", "--kv-cache-memory", "16MiB", "--api-key", API_KEY,
             "--served-model-name", model, "--no-ui", "--tool-call-parser", parser]
    with openai_client(*flags, env={"SLUICE_HOME": str(tmp_path_factory.mktemp("home"))}) as client:
        yield client


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str, set[str]]:
    """Content, (name, arguments) calls, the finish reason and the call ids, from a stream's deltas."""
    content, calls, ids, finish = "", {}, set(), None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.type == "function" and delta.function.name and delta.function.arguments == ""
                    assert delta.index == len(calls)
                    calls[delta.index] = [delta.function.name, ""]
                    ids.add(delta.id)
                else:
                    assert delta.function.name is None
                    calls[delta.index][1] += delta.function.arguments
    return content or None, [tuple(c) for c in calls.values()], finish, ids


def assert_streamed_deltas_reassemble_to_the_unstreamed_reply(client: openai.OpenAI, forced: bool, **request) -> None:
    """`request`'s stream makes up its unstreamed first choice: the same content, calls and finish reason, an id a
    call; where the tool choice `forced` calls, it has some."""
    whole = client.chat.completions.create(**request).choices[0]
    content, calls, finish, ids = reassemble(client.chat.completions.create(**request, stream=True))
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason and len(ids) == len(calls)
    if forced:
        assert calls and finish == "tool_calls"


def assert_required_calls_come_back_valid(client: openai.OpenAI, model: str) -> None:
    """Four replies at temperature 0.8 to ASK with WEATHER and CART `required`, without parallel calls: each one
    call and no content, its arguments valid for its tool's schema."""
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, CART], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.8, seed=1, n=4, max_tokens=200)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
