"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is checked against `anthropic_schemas.py`, then turned into the chat request it means and served by the
chat path (`routes.plan_chat`: prompt through the chat template, tools, grammars forcing calls):

    system                       -> a system message
    text blocks                  -> a message's text
    tool_use blocks (assistant)  -> the assistant message's tool_calls (input as arguments)
    thinking blocks (assistant)  -> the assistant message's reasoning_content (redacted_thinking: left out)
    tool_result blocks (user)    -> tool messages, in place
    tool_choice auto/any/tool/none -> auto/required/named/none; disable_parallel_tool_use -> parallel_tool_calls
    a tool's eager_input_streaming -> its calls' input streamed as sampled (`anthropic_responses.py`)
    max_tokens, stop_sequences, temperature, top_p, top_k -> the sampling fields of the same meaning
    max_tokens past the context window -> the room the window has after the prompt (Anthropic's way)
    a prompt that leaves no room -> Anthropic's 400 "prompt is too long: N tokens > M maximum"
    top_p 0                      -> top_k 1 (chat's top_p is above 0): the most probable token alone
    thinking                     -> chat_template_kwargs' enable_thinking: false if disabled, else true
    thinking.budget_tokens       -> thinking_token_budget, with a --reasoning-parser where each tag is a token
    output_config.effort         -> reasoning_effort (vLLM's mapping)
    output_config.format         -> response_format json_schema (the reply's text is JSON of that schema)

A final assistant message without tool_use blocks (after others) is Anthropic's prefill: the start of the reply,
which the prompt ends with rather than closing it as a turn (the chat request's `continue_final_message`); an
empty one is left out. As on Anthropic's API, a prefill cannot go with `output_config.format`: the grammar would
hold the continuation to the schema, not the prefill and the continuation together. Only the reply's shape is
Anthropic's own (`anthropic_responses.py`): with a --reasoning-parser, the reply's reasoning is a thinking block
before the others.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sluice.app.anthropic_responses import MessageBuilder
from sluice.app.anthropic_schemas import (
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingEnabled,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from sluice.app.errors import APIError, from_validation_error, invalid_request
from sluice.app.generation import respond, start_generation
from sluice.app.reasoning import ReasoningFormat
from sluice.app.routes import json_response, parse_body, plan_chat, render_chat
from sluice.app.schemas import ChatCompletionRequest
from sluice.batching.sampling_params import SamplingParams


async def create_message(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, MessagesRequest)
    if body.thread is not None:
        raise thread_unsupported()
    budgets = state.settings.reasoning_parser is not None and ReasoningFormat.binds_budget(engine.tokenizer)
    chat = await plan_chat(state, engine, chat_request(body, budgets), "input_schema")
    params, windowed = _within_the_window(chat.params, len(chat.prompt.token_ids), engine.max_model_len)
    message_id = f"msg_{uuid.uuid4().hex}"
    eager = frozenset(tool.name for tool in body.tools if tool.eager_input_streaming)
    builder = MessageBuilder(message_id, state.served_name(body.model), len(chat.prompt.token_ids), chat.calling,
                             chat.reasoning, eager, engine.tokenizer, windowed)
    grammar = _ANTHROPIC_FIELD.get(chat.grammar_field, chat.grammar_field)
    generation = await start_generation(request, state, [chat.prompt.token_ids], params, message_id, arrival,
                                        body.model, grammar_param=grammar)
    return await respond(request, generation, builder, body.stream, state.settings.sse_keepalive_s)


# The chat request's fields that hold a grammar, by the names the Messages request gave them.
_ANTHROPIC_FIELD = {"response_format.json_schema.schema": "output_config.format.schema"}


def _within_the_window(params: SamplingParams, prompt_length: int, max_model_len: int
                       ) -> tuple[SamplingParams, bool]:
    """`params` with a max_tokens past the room the context window has after the prompt cut to that room, and
    whether it was: Anthropic's API takes such a max_tokens as the most the window holds (agents ask for 32000),
    its reply stopping with `model_context_window_exceeded` where the window ends. A prompt that leaves no room is
    a 400 in Anthropic's words, which clients match to tell an overflow from other 400s (pydantic-ai's
    ModelContextWindowExceededError, LangChain's ContextOverflowError), where the engine's would say it in OpenAI's."""
    room = max_model_len - prompt_length
    if room < 1:
        raise APIError(400, f"prompt is too long: {prompt_length} tokens > {max_model_len - 1} maximum",
                       param="messages", code="context_length_exceeded")
    if room < params.max_tokens:
        return dataclasses.replace(params, max_tokens=room), True
    return params, False


def thread_unsupported() -> APIError:
    """Sluice holds no message threads (beta). This refusal's error_code is the one the anthropic client's tool
    runner answers by sending the whole history from then on, as for any request a server cannot thread."""
    return APIError(400, "message threads are not supported: send the whole history", param="thread",
                    code="thread_unsupported_request")


async def count_message_tokens(request: Request) -> Response:
    """The length of the prompt `/v1/messages` would render for the same system, messages and tools."""
    state, engine, body = await parse_body(request, CountTokensRequest)
    prompt = await render_chat(state, engine, chat_request(body), "input_schema")
    return json_response(CountTokensResponse(input_tokens=len(prompt.token_ids)))


def _prefills(messages: list[MessageParam]) -> bool:
    """Whether the final message is a prefill: the assistant's, without calls, after other messages."""
    *earlier, last = messages
    calls = any(isinstance(block, ToolUseBlockParam) for block in last.blocks())
    return bool(earlier) and last.role == "assistant" and not calls


def _without_an_empty_prefill(messages: list[MessageParam]) -> list[MessageParam]:
    """The messages less a final assistant message with no text (an empty string, no blocks, or thinking alone):
    Anthropic allows the final one, alone of all, to be empty, and it starts no reply (a text block without
    text, or with whitespace alone, the schema refuses as Anthropic does)."""
    if _prefills(messages) and not _text(messages[-1]):
        return messages[:-1]
    return messages


def _text(message: MessageParam) -> str:
    return "".join(block.text for block in message.blocks() if isinstance(block, TextBlockParam))


def chat_request(body: CountTokensRequest, budgets: bool = False) -> ChatCompletionRequest:
    """The chat request `body` means (see the module's table); what the chat request checks beyond Anthropic's
    schema (a tool_choice naming no tool, say) is a 400 here. `budgets`: whether the server can hold a reply to a
    thinking budget (else, as Anthropic allows, the model thinks as long as it does)."""
    system = body.system_text()
    messages = _without_an_empty_prefill(body.turns())
    data: dict[str, Any] = {
        "messages": ([{"role": "system", "content": system}] if system else [])
                    + [m for message in messages for m in _chat_messages(message)],
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.input_schema, "strict": t.strict}}
                  for t in body.tools],
    }
    if _prefills(messages):
        data |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.thinking is not None:
        data["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
        if budgets and isinstance(body.thinking, ThinkingEnabled):
            data["thinking_token_budget"] = body.thinking.budget_tokens
    if body.output_config is not None:
        data["reasoning_effort"] = body.output_config.effort
        if (output := body.output_config.format) is not None:
            if _prefills(messages):
                raise invalid_request("output_config.format cannot be combined with a prefill (a final assistant "
                                      "message): the schema would hold the reply only, not the prefill it "
                                      "continues", param="output_config.format")
            data["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": output.schema_}}
    if body.tool_choice is not None:
        if isinstance(body.tool_choice, ToolChoiceAny | ToolChoiceTool) and "response_format" in data:
            raise invalid_request("output_config.format cannot be combined with a tool_choice of any or tool: the "
                                  "calls are the output's grammar", param="output_config.format")
        data["tool_choice"] = _tool_choice(body.tool_choice)
        if not isinstance(body.tool_choice, ToolChoiceNone):
            data["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        data |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences} | _sampling(body)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    """The sampling fields `body` sets: those left out take the model's defaults (`plan_chat`). A top_p of 0,
    which Anthropic takes and chat does not, is the nucleus of the most probable token alone: chat's top_k 1."""
    fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if name in body.model_fields_set}
    if fields.get("top_p") == 0:
        del fields["top_p"]
        fields["top_k"] = 1
    return fields


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if isinstance(choice, ToolChoiceAny) else choice.type


def _chat_messages(message: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's is one (text and calls); a user's is its tool
    results and runs of text, in order."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts = [{"type": "text", "text": b.text} for b in message.content if isinstance(b, TextBlockParam)]
        calls = [{"id": b.id, "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in message.content if isinstance(b, ToolUseBlockParam)]
        thoughts = [b.thinking for b in message.content if isinstance(b, ThinkingBlockParam)]
        return [{"role": "assistant", "content": texts, "tool_calls": calls or None,
                 "reasoning_content": "\n".join(thoughts) if thoughts else None}]
    messages: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlockParam):
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"].append({"type": "text", "text": block.text})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": block.text}]})
    return messages
