"""The OpenAI routes: parse and check the body, build the prompts, hand the request to the engine, respond.

Where a request goes: `parse_body` (`schemas.py` checks every field) -> `prompts.py` (token ids) ->
`generation.py` (admission, `Engine.submit` in a worker thread, the collector) -> `responses.py` (OpenAI shapes, SSE).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sluice.batching.engine import Engine
from sluice.batching.sampling_params import RequestRejected, SamplingParams, StructuredOutput
from sluice.model.tokenizer import Tokenizer

from sluice.app.errors import from_validation_error, invalid_grammar, invalid_request
from sluice.app.generation import respond, start_generation
from sluice.app.prompts import Prompt, chat_prompt, tool_call_format, truncated, truncated_prompts
from sluice.app.reasoning import ANY_ANSWER, ReasoningFormat, think_token_ids
from sluice.app.responses import ChatBuilder, CompletionBuilder
from sluice.app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    ToolDefinition,
    takes_only_booleans,
)
from sluice.app.state import ServerState
from sluice.app.tool_calls import (
    ANY_ARGUMENTS,
    NO_ARGUMENTS,
    ToolCalling,
    args_token,
    call_grammar,
    hermes_tags,
    special_marker,
    tag_token_ids,
)

M = TypeVar("M", bound=BaseModel)
_QUERY_BOOLEAN = TypeAdapter(bool)  # lax: a query string's words for true and false

async def parse_body(request: Request, schema: type[M]) -> tuple[ServerState, Engine, M]:
    """The server state, its engine (503 if not ready) and the JSON body checked against `schema` (malformed
    JSON and invalid fields become 400s, an unknown `model` a 404 where the schema has that field)."""
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:  # ValueError: an integer of over 4,300 digits too
        raise invalid_request(f"The body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise invalid_request("The body must be a JSON object")
    if LONE_SURROGATE.search(raw) and (where := _lone_surrogate(data)) is not None:  # before any text is used
        raise invalid_request(f"{where}: a lone UTF-16 surrogate escape is not text", param=where)
    try:
        body = schema.model_validate(data, context={"vocab_size": engine.limits.vocab_size})
    except ValidationError as error:
        raise from_validation_error(error, data) from None
    if "model" in schema.model_fields:
        state.check_model(body.model)
    return state, engine, body


# A \uD800-\uDFFF escape: JSON lets a string hold half of a UTF-16 pair, which no text encoding can write.
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """Where (`messages.0.content`) a string or key of a parsed body holds a lone surrogate, if one does."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and not _is_text(value):
            return where
        if isinstance(value, (dict, list)):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                if isinstance(key, str) and not _is_text(key):
                    return f"{where or 'body'} (a key)"
                stack.append((f"{where}.{key}" if where else str(key), item))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_query(request: Request, schema: type[M]) -> M:
    """The query string checked against `schema` (invalid values are 400s). A list field takes every value of
    its key, written `key=a&key=b` or `key[]=a&key[]=b` (the openai client's way); a boolean field a word
    (`stream=true`, as the openai client writes it; "1", "yes", "on" and their opposites too)."""
    params = request.query_params
    data: dict[str, str | list[str] | bool] = {}
    for key in params.keys():
        name = key.removesuffix("[]")
        field = schema.model_fields.get(name)
        listed = field is not None and typing.get_origin(field.annotation) is list
        data[name] = params.getlist(key) if listed else params[key]
        if field is not None and takes_only_booleans(field.annotation):
            with contextlib.suppress(ValidationError):  # not a word for one: the schema's 400
                data[name] = _QUERY_BOOLEAN.validate_python(data[name])
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error, data) from None


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


async def create_chat_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, ChatCompletionRequest)
    chat = await plan_chat(state, engine, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    builder = ChatBuilder(request_id, state.served_name(body.model), engine.tokenizer, body, chat.prompt.token_ids,
                          chat.calling, chat.reasoning)
    generation = await start_generation(request, state, [chat.prompt.token_ids], chat.params, request_id, arrival,
                                        body.model, "messages", chat.grammar_field)
    return await respond(request, generation, builder, body.stream, state.settings.sse_keepalive_s)


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request becomes before the engine: its prompt, the engine's parameters (with the grammar that
    forces calls, if the tool choice does, and special tokens' text kept where a tag the reply is read for is
    one), and what the reply is read for: calls (None without tools), and reasoning (None without a
    --reasoning-parser). `grammar_field`: the request's field that holds the grammar the output follows (the
    tool_choice that forces calls, or the response format), if one does."""

    prompt: Prompt
    params: SamplingParams
    calling: ToolCalling | None
    reasoning: ReasoningFormat | None
    grammar_field: str | None


async def plan_chat(state: ServerState, engine: Engine, body: ChatCompletionRequest,
                    schema_field: str = "function.parameters") -> ChatPlan:
    """The prompt and parameters of a checked chat request (also what the Responses and Anthropic's Messages APIs
    are turned into; `schema_field`: where the request's tools hold a function's parameters schema)."""
    prompt = await render_chat(state, engine, body, schema_field)
    tools = body.callable_tools()  # the reply is read for calls only of the tools it may call
    parser = tool_call_format(state.settings.tool_call_parser, engine.tokenizer)
    # Without a limit the reply may fill the rest of the context, as OpenAI's chat API allows.
    params = body.sampling_params(max(1, engine.max_model_len - len(prompt.token_ids)), model_defaults(state, engine))
    grammar_field = body.grammar_field()
    if (held := calls_grammar(body, tools, parser, engine.tokenizer)) is not None:
        grammar, grammar_field = held
        params = dataclasses.replace(params, structured=grammar)
    reasoning = ReasoningFormat.named(state.settings.reasoning_parser, continuing=body.continue_final_message)
    budget = body.thinking_token_budget
    if budget is not None and (reasoning is None or not reasoning.binds_budget(engine.tokenizer)):
        needs = "a server started with --reasoning-parser" if reasoning is None else (
            "a vocabulary whose <think> and </think> are tokens")
        raise invalid_request(f"thinking_token_budget needs {needs}", param="thinking_token_budget")
    if reasoning is not None and (params.structured is not None or budget is not None):
        # The grammar (any tokens without one) holds the answer after the thinking, which the budget bounds (one
        # past max_tokens no more than max_tokens does).
        bound = None if budget is None else min(budget, params.max_tokens)
        preamble = reasoning.preamble(engine.tokenizer, bound, engine.limits.eos_token_ids)
        params = dataclasses.replace(params, structured=dataclasses.replace(params.structured or ANY_ANSWER,
                                                                            preamble=preamble))
    # The readers' tags keep their text, where they are special tokens, and no other special token does (vLLM's
    # Mistral, Hermes and reasoning parsers keep every one).
    kept = ((think_token_ids(engine.tokenizer) if reasoning is not None else frozenset())
            | (tag_token_ids(engine.tokenizer, parser) if tools else frozenset()))
    if kept:
        params = dataclasses.replace(params, kept_special_ids=kept)
    calling = (ToolCalling(frozenset(t.function.name for t in tools), parser, bool(body.forced_tools()),
                           body.parallel_tool_calls) if tools else None)
    return ChatPlan(prompt, params, calling, reasoning, grammar_field)


def calls_grammar(body: ChatCompletionRequest, tools: list[ToolDefinition], parser: str, tokenizer: Tokenizer
                  ) -> tuple[StructuredOutput, str] | None:
    """The grammar that holds the reply's calls of `tools` (those it may call) in the format `parser`, with the
    request's field it comes from; None where none does. A forced tool_choice: the reply is calls. Under auto,
    beside the answer a JSON response_format asks for (not with Llama 3's calls: JSON as the answer is, a first
    `{` llguidance reads as one or the other alone); or, where a tool is strict, after free text (not where
    one of Hermes's tags is a special token and the other not: the grammar would spell them in text, which the
    model would not)."""
    if not tools:  # each kind of grammar below needs tools the reply may call
        return None
    forced = body.forced_tools()
    answer = body.response_schema() if not forced and parser != "llama3_json" else None
    tags = hermes_tags(tokenizer, parser)
    chosen = body.holds_chosen_calls() and not (parser == "hermes" and tags is None
                                                and tag_token_ids(tokenizer, parser))
    if not (forced or chosen or answer is not None):
        return None
    functions = ([(t.function.name, t.function.parameters) for t in forced] if forced else
                 [(t.function.name, t.function.parameters if t.function.strict else ANY_ARGUMENTS) for t in tools])
    grammar = call_grammar(functions, body.parallel_tool_calls and not isinstance(body.tool_choice, NamedToolChoice),
                           parser, special_marker(tokenizer, parser), args_token(tokenizer, parser), tags,
                           after_text=chosen, answer_schema=answer)
    return grammar, "tool_choice" if forced else "tools" if chosen else body.grammar_field()


def model_defaults(state: ServerState, engine: Engine) -> Mapping[str, float | int]:
    """The sampling defaults the model sets (`generation_config.json`, GGUF metadata) for the fields a request
    leaves out, unless the server was told to ignore them (`--generation-config vllm`)."""
    return engine.generation_defaults if state.settings.generation_config == "auto" else {}


async def render_chat(state: ServerState, engine: Engine, body: ChatCompletionRequest,
                      schema_field: str = "function.parameters") -> Prompt:
    """The request's prompt (its tools' schemas checked first): rendered, encoded and truncated. The template is
    shown the tools with tool_choice "none" too (as vLLM's), unless the server says otherwise. CPU work (a second
    for a megabyte of text), done in a worker thread so that the event loop serves other requests meanwhile."""
    if body.tools:
        await asyncio.to_thread(check_tool_schemas, engine, body.tools, schema_field)
    tools = body.active_tools(state.settings.exclude_tools_when_tool_choice_none)
    parser = tool_call_format(state.settings.tool_call_parser, engine.tokenizer)

    def render() -> Prompt:
        prompt = chat_prompt(engine.tokenizer, body.messages, tools=tools, call_format=parser, **body.rendering())
        return truncated(engine.tokenizer, prompt, body.truncate_prompt_tokens, engine.max_model_len)

    return await asyncio.to_thread(render)


def check_tool_schemas(engine: Engine, tools: list[ToolDefinition], schema_field: str = "function.parameters"
                       ) -> None:
    """Checks that each function's parameters schema compiles (a millisecond, once per distinct schema): one that
    does not is a 400 naming it (`tools.{i}.{schema_field}`, as the request's API calls it), whether or not a
    grammar will force the calls."""
    for i, tool in enumerate(tools):
        schema = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
        try:
            engine.grammars.check(StructuredOutput("json_schema", json.dumps(schema)))
        except RequestRejected as error:
            raise invalid_grammar(str(error), f"tools.{i}.{schema_field}", json_schema=True) from None


async def create_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, CompletionRequest)
    prompts = await asyncio.to_thread(truncated_prompts, engine.tokenizer, body.prompt, body.truncate_prompt_tokens,
                                      engine.max_model_len, body.add_special_tokens)
    params = body.sampling_params(model_defaults=model_defaults(state, engine))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    builder = CompletionBuilder(request_id, state.served_name(body.model), engine.tokenizer, body, prompts)
    generation = await start_generation(request, state, [p.token_ids for p in prompts], params, request_id, arrival,
                                        body.model, "prompt", body.grammar_field())
    return await respond(request, generation, builder, body.stream, state.settings.sse_keepalive_s)


async def tokenize(request: Request) -> Response:
    """`prompt` is encoded as a completion's; `messages` are first rendered with the chat template, as a chat's."""
    state, engine, body = await parse_body(request, TokenizeRequest)
    if body.messages is not None:
        ids = (await asyncio.to_thread(
            chat_prompt, engine.tokenizer, body.messages, tools=body.tools or [],
            call_format=tool_call_format(state.settings.tool_call_parser, engine.tokenizer), **body.rendering()
        )).token_ids
    else:
        ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    strings = engine.tokenizer.vocab_strings(ids) if body.return_token_strs else None
    return json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len,
                                          token_strs=strings))


async def detokenize(request: Request) -> Response:
    _, engine, body = await parse_body(request, DetokenizeRequest)
    return json_response(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))
