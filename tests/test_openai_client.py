"""The official `openai` client (and raw bodies) against the app over a real engine (a tiny random model with
SmolLM2's tokenizer, in-process): request fields the OpenAI API accepts reach the engine as OpenAI means them."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import openai
import pytest
from flax import nnx

from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4,
                      kv_cache_memory=1 << 20, num_decode_steps=1, warmup=False)
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def tiny_engine(smollm2, config: EngineConfig) -> Engine:
    # The tokenizer's whole vocabulary, so that the chat template's ids are the model's.
    model_config = ModelConfig.tiny(vocab_size=smollm2.tokenizer.vocab_size)
    loaded = LoadedModel(model_config, Llama(model_config, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")
    return Engine(loaded, config, progress=False)


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    return tiny_engine(smollm2, CONFIG)


@pytest.fixture(scope="module")
def tool_engine(smollm2) -> Engine:
    """With room for the tools SmolLM2's template is shown in (the Hermes system prompt: about 150 tokens for one)."""
    return tiny_engine(smollm2, dataclasses.replace(CONFIG, max_model_len=384, kv_cache_memory=4 << 20))


def serve(engine: Engine, scenario, **settings):
    """Runs `scenario(client, http)`, an `openai.AsyncOpenAI` on the app and the `httpx.AsyncClient` under it,
    with the engine's step loop started; `settings`: the server's (`ServerSettings`)."""

    async def run():
        state = ServerState(ServerSettings(**settings))
        state.set_engine(engine)
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://sluice/v1", timeout=60) as http:
                return await scenario(openai.AsyncOpenAI(api_key="none", base_url="http://sluice/v1",
                                                         http_client=http), http)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_a_negative_seed_as_openai_allows_samples_the_same_reply_twice(engine):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[str]:
        replies = [await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                        temperature=1.0, seed=-7) for _ in range(2)]
        return [reply.choices[0].message.content for reply in replies]

    first, again = serve(engine, scenario)
    assert first and first == again


def test_a_body_nested_deeper_than_the_json_parser_goes_is_a_400(engine):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/chat/completions", content=b"[" * 100_000,
                               headers={"content-type": "application/json"})

    response = serve(engine, scenario)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


DEEP_ARGUMENTS = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    ("/completions", '{"prompt": ["fine", "\\uDC00"], "max_tokens": 1}', "prompt.1"),
    ("/chat/completions", '{"model": "\\udbff", "messages": []}', "model"),
    ("/messages", '{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "metadata": {"\\ud801": 1}}',
     "metadata (a key)"),
    ("/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + "0" * 5000 + "}",
     None),
    ("/chat/completions", '{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
     '"function": {"name": "f", "arguments": "' + DEEP_ARGUMENTS + '"}}]}]}', "messages.0.tool_calls.0.function.arguments"),
])
def test_text_no_encoding_writes_numbers_past_the_parsers_limit_and_deep_arguments_are_400s(engine, path, body, param):
    """Each of these was a 500: a lone surrogate reached the tokenizer (or the 404's message), an integer of 5,000
    digits and arguments nested 50,000 deep raised past the parsers' handlers."""
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, content=body.encode(), headers={"content-type": "application/json"})

    response = serve(engine, scenario)
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error.get("param") == param if path != "/messages" else param in error["message"]


def test_a_stop_string_may_be_longer_than_the_number_of_stop_strings_allowed(engine):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                                    stop="a stop string of 30 characters")

    assert serve(engine, scenario).choices[0].finish_reason == "length"


def test_a_completion_left_without_max_tokens_or_with_null_takes_16_tokens(engine):
    """The completions API's default (OpenAI's); null reads as left out, as every field's here."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[dict]:
        body = {"model": "tiny", "prompt": "Hello there", "temperature": 0, "ignore_eos": True}
        replies = [await http.post("/completions", json=fields) for fields in (body, body | {"max_tokens": None})]
        return [reply.json()["usage"]["completion_tokens"] for reply in replies]

    assert serve(engine, scenario) == [16, 16]


async def stream_chunks(http: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    """A stream's chunks, [DONE] left out."""
    async with http.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def counts(usage: dict | None) -> tuple[int, int, int] | None:
    return None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", {"messages": MESSAGES}),
                                            ("/completions", {"prompt": ["Hello there", "Hi"]}),
                                            ("/completions", {"prompt": ["Hello there", "Hi"], "echo": True,
                                                              "logprobs": 1})])
def test_continuous_usage_stats_give_every_chunk_its_choices_tokens_so_far(engine, path, body):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts its choice's prompt and the tokens
    sent so far (none on a chat's opening chunks, nor on an echo's); the last chunk the whole request's."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple[list[dict], dict]:
        request = body | {"model": "tiny", "max_tokens": 5, "temperature": 0, "n": 2, "ignore_eos": True,
                          "return_token_ids": True}
        chunks = await stream_chunks(http, path, request | {"stream_options": {"include_usage": True,
                                                                               "continuous_usage_stats": True}})
        return chunks, (await http.post(path, json=request)).json()

    chunks, whole = serve(engine, scenario)
    prompts = ([len(c["prompt_token_ids"]) for c in whole["choices"]] if path == "/completions"
               else [len(whole["prompt_token_ids"])] * 2)
    generated = [0] * len(whole["choices"])
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        generated[choice["index"]] += len(choice.get("token_ids", []))
        prompt, so_far = prompts[choice["index"]], generated[choice["index"]]
        assert counts(chunk["usage"]) == (prompt, so_far, prompt + so_far)
    assert generated == [5] * len(whole["choices"])
    assert chunks[-1]["choices"] == [] and counts(chunks[-1]["usage"]) == counts(whole["usage"])


def test_a_prompt_of_token_ids_is_echoed_with_its_special_tokens_text_as_the_same_prompt_written_out(engine):
    """vLLM echoes a prompt of ids as their whole text; with special tokens' text left out, the echo was not the
    prompt, and the echoed logprobs' tokens and text_offset did not match the text."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list:
        ids = (await http.post("http://sluice/tokenize", json={"prompt": "<|im_start|>user\nHi"})).json()["tokens"]
        replies = [await client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                   echo=True, logprobs=0) for prompt in (ids, "<|im_start|>user\nHi")]
        return [(reply.choices[0].text, reply.choices[0].logprobs) for reply in replies]

    (from_ids, logprobs), (from_text, _) = serve(engine, scenario)
    assert from_ids == from_text and from_ids.startswith("<|im_start|>user\nHi")
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_a_prompt_too_long_for_the_context_is_openais_context_length_exceeded_naming_the_prompts_field(engine):
    """Agent SDKs read the code to shorten a conversation; `param` is the field that holds the prompt."""
    long_text = "apple pear plum " * 60  # about 180 tokens, past the context of 128

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[openai.BadRequestError]:
        calls = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_text}]),
                 client.completions.create(model="tiny", prompt=long_text),
                 client.responses.create(model="tiny", input=long_text),
                 client.embeddings.create(model="tiny", input=long_text)]
        errors = []
        for call in calls:
            with pytest.raises(openai.BadRequestError) as raised:
                await call
            errors.append(raised.value)
        return errors

    errors = serve(engine, scenario)
    assert [(error.code, error.param) for error in errors] == [("context_length_exceeded", "messages"),
                                                               ("context_length_exceeded", "prompt"),
                                                               ("context_length_exceeded", "input"),
                                                               ("context_length_exceeded", "input")]
    assert all("maximum context length is 128 tokens" in error.message for error in errors)


BAD_SCHEMA = {"type": "strin"}  # valid JSON, no JSON schema: only compiling it finds that


@pytest.mark.parametrize(("api", "fields", "param", "code"), [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex", None),
    ("completions", {"extra_body": {"structured_outputs": {"json": BAD_SCHEMA}}}, "structured_outputs.json",
     "invalid_json_schema"),
    ("completions", {"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}},
     "structured_outputs.grammar", None),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
     "text.format.schema", "invalid_json_schema"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": BAD_SCHEMA}}}}]}, "tools.0.function.parameters", "invalid_json_schema"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field_that_holds_it(engine, api, fields, param, code):
    """As OpenAI's own refusal of a schema (`param` "text.format.schema", `code` "invalid_json_schema", which agent
    CLIs match): found only when the engine compiles the grammar, after every field was checked."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        calls = {"chat": lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, **fields),
                 "completions": lambda: client.completions.create(model="tiny", prompt="hi", **fields),
                 "responses": lambda: client.responses.create(model="tiny", input="hi", **fields)}
        with pytest.raises(openai.BadRequestError) as raised:
            await calls[api]()
        return raised.value

    error = serve(engine, scenario)
    assert (error.param, error.code) == (param, code) and error.body["message"].startswith(f"{param}: "), error.body


def test_a_request_the_engine_refuses_names_its_field(engine):
    """Fields only the engine can check (min_tokens against the max_tokens it resolves) are 400s naming the field."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                                 extra_body={"min_tokens": 3})
        return raised.value

    too_few = serve(engine, scenario)
    assert (too_few.param, too_few.code) == ("min_tokens", None), too_few.body
    assert "min_tokens (3) must not exceed the maximum number of tokens (2)" in too_few.body["message"]


# --- tool calling as OpenAI's and vLLM's clients read it ------------------------------------------------------

LOOK_PARAMETERS = {"type": "object", "properties": {}}
LOOK = {"type": "function", "function": {"name": "look", "description": "Looks around", "parameters": LOOK_PARAMETERS}}
CALL_TEXT = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_shows_the_model_the_tools_unless_the_server_excludes_them_in_every_api(tool_engine, exclude):
    """vLLM (since 0.10) renders the tools into the prompt with tool_choice "none" too (the model knows them; no
    call is read from its reply); --exclude-tools-when-tool-choice-none leaves them out, as before. The Responses
    API and Anthropic's Messages API (`tool_choice: {"type": "none"}`) follow the chat request they become."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple[int, ...]:
        async def chat_prompt_tokens(**fields) -> int:
            reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                         temperature=0, **fields)
            return reply.usage.prompt_tokens

        bare = await chat_prompt_tokens()
        auto = await chat_prompt_tokens(tools=[LOOK], tool_choice="auto")
        none = await chat_prompt_tokens(tools=[LOOK], tool_choice="none")
        response = await client.responses.create(model="tiny", input=MESSAGES[0]["content"], tool_choice="none",
                                                 tools=[{"type": "function", **LOOK["function"]}],
                                                 max_output_tokens=1, temperature=0)
        prompt = {"model": "tiny", "messages": MESSAGES, "tool_choice": {"type": "none"},
                  "tools": [{"name": "look", "description": "Looks around", "input_schema": LOOK_PARAMETERS}]}
        message = (await http.post("/messages", json={**prompt, "max_tokens": 1, "temperature": 0})).json()
        usage = message["usage"]
        anthropic = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        counted = (await http.post("/messages/count_tokens", json=prompt)).json()["input_tokens"]
        return bare, auto, none, response.usage.input_tokens, anthropic, counted

    bare, auto, none, *others = serve(tool_engine, scenario,
                                      **({"exclude_tools_when_tool_choice_none": True} if exclude else {}))
    assert auto > bare
    assert [none, *others] == [bare if exclude else auto] * 4


@pytest.mark.parametrize("stream", [False, True])
def test_with_tool_choice_none_a_reply_written_as_a_call_is_its_content_not_a_call(tool_engine, stream):
    """The tools are in the prompt, but with "none" the reply is not read for calls: vLLM's content is the text."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[tuple]:
        replies = []
        for tool_choice in ("none", "auto"):
            body = {"model": "tiny", "messages": MESSAGES, "tools": [LOOK], "tool_choice": tool_choice,
                    "max_tokens": 40, "temperature": 0, "structured_outputs": {"choice": [CALL_TEXT]}}
            if not stream:
                choice = (await http.post("/chat/completions", json=body)).json()["choices"][0]
                calls = [(c["function"]["name"], c["function"]["arguments"])
                         for c in choice["message"].get("tool_calls") or []]
                replies.append((choice["message"]["content"], calls, choice["finish_reason"]))
                continue
            chunks = await stream_chunks(http, "/chat/completions", body)
            deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
            content = "".join(delta.get("content") or "" for delta in deltas) or None
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for delta in deltas for c in delta.get("tool_calls", []) if "id" in c]
            replies.append((content, calls, chunks[-1]["choices"][0]["finish_reason"]))
        return replies

    none, auto = serve(tool_engine, scenario)
    assert none == (CALL_TEXT, [], "stop")
    assert auto[1:] == ([("look", "" if stream else "{}")], "tool_calls")  # streamed: the arguments come after


def test_a_streamed_reply_that_opens_with_a_call_opens_as_openais_with_content_null_beside_the_call(tool_engine):
    """OpenAI's first chunk of a reply that starts with a call is `{"role": "assistant", "content": null,
    "tool_calls": [...]}`: content "" there made the openai client's stream helper end with content "" where the
    unstreamed reply has null."""
    strict = {"type": "function", "function": {**LOOK["function"], "strict": True}}  # the stream helper asks for it
    body = {"model": "tiny", "messages": MESSAGES, "tools": [strict], "max_tokens": 40, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "look"}}}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple:
        chunks = await stream_chunks(http, "/chat/completions", body)
        whole = await client.chat.completions.create(**body)
        async with client.chat.completions.stream(**body) as events:
            final = await events.get_final_completion()
        text = await stream_chunks(http, "/chat/completions", {**body, "tool_choice": "auto",
                                                               "structured_outputs": {"choice": ["Blue"]}})
        return chunks, whole, final, text

    chunks, whole, final, text = serve(tool_engine, scenario)
    assert whole.choices[0].message.content is None and final.choices[0].message.content is None
    first = chunks[0]["choices"][0]["delta"]
    [call] = first.pop("tool_calls")
    assert first == {"role": "assistant", "content": None}
    assert call["index"] == 0 and call["type"] == "function" and call["function"] == {"name": "look", "arguments": ""}
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:])
    assert ([c.function.model_dump(include={"name", "arguments"}) for c in final.choices[0].message.tool_calls]
            == [c.function.model_dump() for c in whole.choices[0].message.tool_calls])
    # A reply that opens with text opens as before, as OpenAI's does: the role with content "".
    assert text[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in text[:-1]) == "Blue"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": 5, "schema": {}}}}, "response_format.json_schema.name"),
    ("/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi", "reasoning": "x"}]}, "messages.0.reasoning"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}]},
     "messages.0.reasoning_content"),
    ("/chat/completions", {"messages": MESSAGES, "stop": 5}, "stop"),
    ("/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}},
     "text.format.name"),
])
def test_an_invalid_fields_param_is_its_path_as_the_client_sent_it(engine, path, body, param):
    """Not a union member's tag or type (`response_format.json_schema.json_schema.name`, `stop.str`), nor a field's
    other name (`reasoning_content` for the `reasoning` sent)."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, json={"model": "tiny", **body})

    response = serve(engine, scenario)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# --- fields the current client and agent SDKs send ----------------------------------------------------------

WAIT = {"type": "function", "function": {"name": "wait", "description": "Waits", "parameters": LOOK_PARAMETERS}}


def allowed(mode: str, *names: str) -> dict:
    """Chat's `allowed_tools` tool_choice: the model may call only the `names` of the request's tools."""
    return {"type": "allowed_tools",
            "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def test_allowed_tools_required_forces_a_call_of_a_listed_tool_with_every_tool_in_the_prompt(tool_engine):
    """OpenAI's newer tool_choice: every tool stays in the prompt (its cached prefix), the call is one of those
    listed; the Responses API's flat form does the same."""
    flat = [{"type": "function", **tool["function"]} for tool in (LOOK, WAIT)]

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple:
        fields = {"model": "tiny", "messages": MESSAGES, "tools": [LOOK, WAIT], "max_tokens": 30, "temperature": 0,
                  "parallel_tool_calls": False}  # a random model would write calls to the end
        auto = await client.chat.completions.create(**fields, tool_choice="auto")
        forced = await client.chat.completions.create(**fields, tool_choice=allowed("required", "wait"))
        response = await client.responses.create(
            model="tiny", input=MESSAGES[0]["content"], tools=flat, max_output_tokens=30, temperature=0,
            parallel_tool_calls=False,
            tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "wait"}]})
        return auto, forced, response

    auto, forced, response = serve(tool_engine, scenario)
    assert forced.usage.prompt_tokens == auto.usage.prompt_tokens
    assert [call.function.name for call in forced.choices[0].message.tool_calls] == ["wait"]
    assert forced.choices[0].finish_reason == "tool_calls"
    assert [(item.type, item.name) for item in response.output] == [("function_call", "wait")]
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.mode == "required"


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_tools_auto_reads_calls_of_the_listed_tools_only(tool_engine, stream):
    """A call of a tool left off the list is text, as with tool_choice "none"."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[tuple]:
        replies = []
        for names in (("look",), ("wait",)):
            body = {"model": "tiny", "messages": MESSAGES, "tools": [LOOK, WAIT],
                    "tool_choice": allowed("auto", *names), "max_tokens": 40, "temperature": 0,
                    "extra_body": {"structured_outputs": {"choice": [CALL_TEXT]}}}
            if stream:
                async with client.chat.completions.stream(**body) as events:
                    reply = await events.get_final_completion()
            else:
                reply = await client.chat.completions.create(**body)
            message = reply.choices[0].message
            replies.append((message.content, [c.function.name for c in message.tool_calls or []]))
        return replies

    listed, unlisted = serve(tool_engine, scenario)
    assert listed == (None, ["look"])
    assert unlisted == (CALL_TEXT, [])


@pytest.mark.parametrize(("choice", "param", "words"), [
    (allowed("auto", "nope"), "tool_choice", "'nope', which is not among the tools"),
    (allowed("auto"), "tool_choice.allowed_tools.tools", "at least 1 item"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "custom", "custom": {}}]}},
     "tool_choice.allowed_tools.tools.0.type", "'function'"),
])
def test_an_allowed_tools_choice_naming_no_tool_of_the_request_is_a_400_naming_it(engine, choice, param, words):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[LOOK], tool_choice=choice)
        return raised.value

    error = serve(engine, scenario)
    assert error.param == param and words in error.message, error.message


def test_an_assistants_refusal_sent_back_is_its_text_in_the_prompt(engine):
    """The openai client's assistant message may hold a refusal, as its `refusal` field or a refusal part (the
    Agents SDK sends a refused turn's history so); vLLM reads a refusal part as text."""
    said = "I can't help with that."

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[list[int]]:
        prompts = []
        for assistant in ({"content": said}, {"content": None, "refusal": said},
                          {"content": [{"type": "refusal", "refusal": said}]}):
            messages = [*MESSAGES, {"role": "assistant", **assistant}, {"role": "user", "content": "Why?"}]
            response = await http.post("http://sluice/tokenize", json={"model": "tiny", "messages": messages})
            assert response.status_code == 200, response.json()
            prompts.append(response.json()["tokens"])
        return prompts

    as_text, as_field, as_part = serve(engine, scenario)
    assert as_field == as_text and as_part == as_text


def test_a_refusal_part_in_a_users_message_is_a_400_naming_it(engine):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=[
                {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
        return raised.value

    error = serve(engine, scenario)
    assert error.param == "messages.0.content" and "refusal" in error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"extra_body": {"moderation": {"model": "omni-moderation-latest", "policy": {"output": {"mode": "block"}}}}},
     "moderation"),
])
def test_asking_chat_for_audio_a_web_search_or_moderation_is_a_400_naming_the_field(engine, fields, param):
    """They would change the reply (`message.audio`, a searched answer, one blocked), which Sluice cannot give."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
        return raised.value

    assert serve(engine, scenario).param == param


def test_fields_that_do_not_change_the_reply_are_accepted_and_leave_it_as_it_was(engine):
    """What the openai client and the Agents SDK send for OpenAI's own service (its store, billing, caching,
    routing and moderation hints) is taken and ignored, as vLLM ignores it."""
    ignored = {"store": True, "metadata": {"run": "1"}, "service_tier": "auto", "prompt_cache_key": "agent-1",
               "safety_identifier": "user-1", "user": "user-1", "verbosity": "low", "modalities": ["text"],
               "prediction": {"type": "content", "content": "Blue"}, "reasoning_effort": "low",
               "extra_body": {"prompt_cache_retention": "24h"}}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[str]:
        fields = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        plain = await client.chat.completions.create(**fields)
        given = await client.chat.completions.create(**fields, **ignored)
        streamed = await client.chat.completions.create(
            **fields, **ignored, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in streamed if chunk.choices])
        return [plain.choices[0].message.content, given.choices[0].message.content, text]

    plain, given, streamed = serve(engine, scenario)
    assert given == plain and streamed == plain


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True, "store": False}, "background"),  # served with store only
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"extra_body": {"moderation": {"model": "omni-moderation-latest"}}}, "moderation"),
])
def test_a_responses_field_sluice_does_not_serve_is_a_400_naming_it(engine, fields, param):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model="tiny", input="hi", **fields)
        return raised.value

    error = serve(engine, scenario)
    assert error.param == param and error.body["message"].startswith(f"{param}: "), error.body


def test_responses_max_tool_calls_caps_built_in_tools_of_which_there_are_none_and_is_echoed(engine):
    """OpenAI's `max_tool_calls` bounds calls of its built-in (hosted) tools; function calls are the client's."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient):
        return await client.responses.create(model="tiny", input="hi", max_tool_calls=2, max_output_tokens=2)

    assert serve(engine, scenario).max_tool_calls == 2


@pytest.fixture
def failing_engine(smollm2, monkeypatch) -> Engine:
    """An engine whose second step's first row gets NaN logits (`SLUICE_FAULT`): that request fails alone."""
    monkeypatch.setenv("SLUICE_FAULT", "nan@2")
    return tiny_engine(smollm2, CONFIG)


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_a_generation_failing_after_a_streams_200_is_an_error_event_then_the_end_the_client_raises_or_reads(
        failing_engine, api):
    """OpenAI's shape after the 200: chat and completions send `{"error": {...}}` then `[DONE]`, which the openai
    client raises as `APIError`; the Responses API ends with a `response.failed` event carrying the error."""

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list:
        if api == "responses":
            stream = await client.responses.create(model="tiny", input="hi", max_output_tokens=8, stream=True)
            return [event async for event in stream]
        create = client.chat.completions.create if api == "chat" else client.completions.create
        prompt = {"messages": MESSAGES} if api == "chat" else {"prompt": "hi"}
        stream = await create(model="tiny", max_tokens=8, stream=True, **prompt)
        with pytest.raises(openai.APIError) as raised:
            async for _ in stream:
                pass
        assert not isinstance(raised.value, openai.APIStatusError)  # the status was 200
        return [raised.value]

    events = serve(failing_engine, scenario)
    if api == "responses":
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e.type for e in events].count("response.failed") == 1 and events[-1].type == "response.failed"
        error = events[-1].response.error
        assert events[-1].response.status == "failed" and error.code == "server_error"
        openai.types.responses.Response.model_validate(events[-1].response.to_dict())  # its code one of OpenAI's
    else:
        error = events[0]
    assert "generation failed" in error.message


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_a_generation_failing_before_a_reply_is_a_500_the_client_raises_as_internal_server_error(failing_engine, api):
    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> openai.InternalServerError:
        client = client.with_options(max_retries=0)  # a retry would succeed: the fault strikes once
        calls = {"chat": lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8),
                 "completions": lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=8),
                 "responses": lambda: client.responses.create(model="tiny", input="hi", max_output_tokens=8)}
        with pytest.raises(openai.InternalServerError) as raised:
            await calls[api]()
        return raised.value

    error = serve(failing_engine, scenario)
    assert error.status_code == 500 and (error.body["type"], error.body["code"]) == ("server_error", "generation_error")


FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
STRICT_LOOK = {"type": "function", "function": {**LOOK["function"], "parameters": FLAG, "strict": True}}
BLUE = {"choice": ["Blue"]}  # a reply that ends (the random model would write to max_tokens)
CHAT_VARIANTS = {
    "text with logprobs": {"logprobs": True, "top_logprobs": 2, "extra_body": {"structured_outputs": BLUE}},
    "two samples": {"n": 2, "temperature": 0.8, "seed": 3, "extra_body": {"structured_outputs": BLUE}},
    "named call": {"tools": [STRICT_LOOK], "tool_choice": {"type": "function", "function": {"name": "look"}}},
    "required call": {"tools": [STRICT_LOOK], "tool_choice": "required", "parallel_tool_calls": False},
    "json schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "flag", "strict": True, "schema": FLAG}}},
}


def without_ids(completion) -> dict:
    """A chat completion but for what differs between two requests (ids, time, the prefix cache's count), and the
    stream helper's additions (`parsed`, a call's `index`)."""
    data = completion.model_dump(exclude={"id", "created", "usage", "prompt_logprobs"})
    for choice in data["choices"]:
        choice["message"].pop("parsed", None)
        for call in choice["message"]["tool_calls"] or []:
            del call["id"]
            call.pop("index", None)
            call["function"].pop("parsed_arguments", None)
    return data


def response_without_ids(response) -> dict:
    """`without_ids` of a Responses API response."""
    data = response.model_dump(exclude={"id", "created_at", "usage", "output_parsed"})
    for item in data["output"]:
        for key in ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return data


@pytest.mark.parametrize("variant", CHAT_VARIANTS)
def test_the_chat_stream_helpers_final_completion_is_the_unstreamed_one(tool_engine, variant):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **CHAT_VARIANTS[variant]}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple:
        whole = await client.chat.completions.create(**body)
        async with client.chat.completions.stream(**body) as events:
            return whole, await events.get_final_completion()

    whole, final = serve(tool_engine, scenario)
    assert whole.choices[0].finish_reason in ("stop", "tool_calls")
    assert without_ids(final) == without_ids(whole)


@pytest.mark.parametrize("variant", ["text with logprobs", "named call"])
def test_the_responses_stream_helpers_final_response_is_the_unstreamed_one(tool_engine, variant):
    fields = {"text with logprobs": {"include": ["message.output_text.logprobs"], "top_logprobs": 2, "text": {
                  "format": {"type": "json_schema", "name": "flag", "strict": True, "schema": FLAG}}},
              "named call": {"tools": [{"type": "function", **STRICT_LOOK["function"]}],
                             "tool_choice": {"type": "function", "name": "look"}}}[variant]
    body = {"model": "tiny", "input": MESSAGES[0]["content"], "max_output_tokens": 60, "temperature": 0, **fields}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> tuple:
        whole = await client.responses.create(**body)
        async with client.responses.stream(**body) as events:
            return whole, await events.get_final_response()

    whole, final = serve(tool_engine, scenario)
    assert whole.status == "completed"
    assert response_without_ids(final) == response_without_ids(whole)


def test_every_body_chunk_and_event_is_valid_as_the_openai_clients_types(tool_engine):
    """The client builds its models without checking them; pydantic's check of its types finds a required field
    missing or of another type, in each body, chunk and event (with logprobs, n, calls and usage)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 30, "logprobs": True, "top_logprobs": 2, "n": 2,
            "tools": [STRICT_LOOK], "tool_choice": "auto", "structured_outputs": {"choice": ["Blue", CALL_TEXT]}}
    responses = {"model": "tiny", "input": "hi", "max_output_tokens": 30, "include": ["message.output_text.logprobs"],
                 "tools": [{"type": "function", **STRICT_LOOK["function"]}], "tool_choice": "required"}

    async def scenario(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> list[tuple[type, list[dict]]]:
        # Neither echoed with logprobs nor streamed: the prompt's first token's null logprob (OpenAI's, which lm-eval
        # reads) and a chunk's null finish_reason (OpenAI's too) are not in the client's type.
        completion = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": 1}
        checked = [(ChatCompletion, [(await http.post("/chat/completions", json=chat)).json()]),
                   (Completion, [(await http.post("/completions", json=completion)).json()]),
                   (Response, [(await http.post("/responses", json=responses)).json()]),
                   (ChatCompletionChunk, await stream_chunks(http, "/chat/completions",
                                                             {**chat, "stream_options": {"include_usage": True}}))]
        async with http.stream("POST", "/responses", json={**responses, "stream": True}) as response:
            events = [json.loads(line.removeprefix("data: ")) async for line in response.aiter_lines()
                      if line.startswith("data: ")]
        return [*checked, (ResponseStreamEvent, events)]

    for kind, bodies in serve(tool_engine, scenario):
        for body in bodies:
            TypeAdapter(kind).validate_python(body)
