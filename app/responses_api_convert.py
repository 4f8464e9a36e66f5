"""A Responses request turned into the chat request the chat path serves, and a reply's output turned back into
input items (what `previous_response_id` continues from, and `input_items` lists).

The chat request's model checks what both APIs share (tool names, `tool_choice` among the tools, forced calls
against a format); its complaints come back under the Responses API's field names.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sluice.app.errors import APIError, from_validation_error, invalid_request
from sluice.app.response_ids import new_id
from sluice.app.responses_api_schemas import (
    AllowedToolsChoice,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputItem,
    InputItemList,
    InputItemsQuery,
    InputText,
    JsonSchemaTextFormat,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputTextPart,
    ReasoningItem,
    ResponsesRequest,
    ToolChoice,
)
from sluice.app.schemas import ChatCompletionRequest, RefusalPart

Items = list[InputItem]
ITEMS = TypeAdapter(Items)
ITEM = TypeAdapter(InputItem)
# Chat fields under their Responses names, for errors.
_RESPONSES_NAME = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(body: ResponsesRequest, items: Items) -> ChatCompletionRequest:
    """The chat completion `body` asks for, over the conversation `items` (an earlier response's, then `body`'s)."""
    check_ids_distinct(item.id for item in items)
    _check_calls_answered(items)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict[str, Any] = {
        "messages": messages + chat_messages(items),
        "max_completion_tokens": body.max_output_tokens,
        "logprobs": body.logprobs,
        "top_logprobs": body.top_logprobs,
        "stream": body.stream,
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in body.tools],
        "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    }
    # Sampling fields left out take the model's defaults (`plan_chat`), so only those set are passed on.
    chat |= {name: getattr(body, name) for name in ("temperature", "top_p") if name in body.model_fields_set}
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = body.text.format
    if isinstance(text_format, JsonSchemaTextFormat):
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": text_format.model_dump(exclude={"type"}, exclude_none=True)}
    elif text_format.type != "text":
        chat["response_format"] = {"type": text_format.type}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:
        raise in_responses_terms(from_validation_error(error, chat)) from None


def _chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """A tool_choice in the chat request's form: its functions named under `function`."""
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedToolsChoice):
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": [
            _chat_tool_choice(tool) for tool in choice.tools]}}
    return choice


def check_ids_distinct(ids: Iterable[str | None], param: str = "input") -> None:
    """An item may come once (a 400 otherwise, as OpenAI's): sent again, by reference or whole, after the earlier
    response or in the conversation that holds it, it would show the model that turn twice. `ids`: the items'
    (None for one without), in order; `param`: the field that holds the later ones."""
    seen: set[str] = set()
    for item_id in ids:
        if item_id in seen:
            raise invalid_request(f"Duplicate item found with id {item_id}. Remove duplicate items from your {param} "
                                  "and try again.", param=param)
        if item_id is not None:
            seen.add(item_id)


def _check_calls_answered(items: Items) -> None:
    """Each function call output must answer a call made before it, and each call must be answered (a 400
    otherwise, as OpenAI's): the model would be shown the result of a call it never made, or a call that had none."""
    answered: dict[str, bool] = {}  # each call's id, in order: whether an output answers it
    for item in items:
        if isinstance(item, FunctionCallItem):
            answered[item.call_id] = False
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in answered:
                raise invalid_request(f"No tool call found for function call output with call_id '{item.call_id}'",
                                      param="input")
            answered[item.call_id] = True
    if unanswered := [call_id for call_id, done in answered.items() if not done]:
        raise invalid_request(f"No tool output found for function call {unanswered[0]}.", param="input")


def chat_messages(items: Items) -> list[dict[str, Any]]:
    """Chat messages (dicts) of the items: a function call joins the assistant turn before it (its text, or the
    calls made alongside it), and so does an assistant's text right after calls (a chat turn holds one text and its
    calls, and vLLM joins them so too); a call's output is a `tool` message. Reasoning items are the reasoning of
    the assistant turn their next item is part of (as the reply that wrote them had it); followed by no such item
    (a reply that was all reasoning, cut by max_output_tokens, say), an assistant message of their own, as vLLM
    makes them."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            if text := item.text():
                reasoning.append(text)
            continue
        if reasoning and not (isinstance(item, FunctionCallItem)
                              or isinstance(item, MessageItem) and item.role == "assistant"):
            messages.append(_reasoning_turn(reasoning))
            reasoning = []
        if isinstance(item, MessageItem) and item.role == "assistant" and _is_calls_turn(messages):
            messages[-1]["content"] = item.text()
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if reasoning and messages[-1]["role"] == "assistant":
            earlier = [messages[-1]["reasoning_content"]] if "reasoning_content" in messages[-1] else []
            messages[-1]["reasoning_content"] = "\n".join(earlier + reasoning)
        reasoning = []
    return [*messages, _reasoning_turn(reasoning)] if reasoning else messages


def _is_calls_turn(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant turn of calls without text."""
    return bool(messages) and messages[-1]["role"] == "assistant" and "content" not in messages[-1]


def _reasoning_turn(reasoning: list[str]) -> dict[str, Any]:
    return {"role": "assistant", "reasoning_content": "\n".join(reasoning)}


def output_items(output: list[OutputItem]) -> Items:
    """A reply's output as the input items that stand for it in a later conversation. A call not written whole is
    left out (one cut short by `max_output_tokens`, incomplete, or by a cancel or a failure, still in progress): its
    arguments are not JSON, and no output can answer it."""
    return ITEMS.validate_python([item.model_dump() for item in output
                                  if not (isinstance(item, OutputFunctionCall) and item.status != "completed")])


_ID_PREFIX = {MessageItem: "msg", FunctionCallItem: "fc", FunctionCallOutputItem: "fco", ReasoningItem: "rs"}


def stored_items(items: Items, replica: str, held: Callable[[str], bool] = lambda item_id: True) -> Items:
    """The items as a stored conversation lists them (OpenAI's input item shape): each with an `id` and a `status`,
    a message's text as a list of its role's parts. The `id` is the item's own where `held` says this server holds
    an item by it (an earlier output item, or an item it stored, sent back; by default every id is held: the items
    are the server's, a reply's output), else a new one naming the `replica` that stores it: so an id a client chose
    (`msg_1`, or one shaped as the server's) neither collides with another client's nor lets an `item_reference`
    reach another's item; a held id names its item for whoever knows it. Check a client's ids (`check_ids_distinct`)
    before: these are no longer theirs."""
    stored = []
    for item in items:
        given = item.id if item.id is not None and held(item.id) else None
        update: dict[str, Any] = {"id": given or new_id(_ID_PREFIX[type(item)], replica),
                                  "status": item.status or "completed"}
        if isinstance(item, MessageItem):
            update["content"] = _stored_parts(item)
        stored.append(item.model_copy(update=update))
    return stored


def _stored_parts(message: MessageItem) -> list[InputText | OutputTextPart | RefusalPart]:
    """A message's text as OpenAI's message items hold it, whichever part (or string) it came as: an assistant's
    as output text, another role's as input text; a refusal as it is."""
    parts = [InputText(text=message.content)] if isinstance(message.content, str) else message.content
    text_part = OutputTextPart if message.role == "assistant" else InputText
    return [part if isinstance(part, RefusalPart) else text_part(text=part.text) for part in parts]


def item_page(ids: Sequence[str], positions: Mapping[str, int], item_of: Callable[[str], InputItem],
              query: InputItemsQuery, owner: str) -> InputItemList:
    """A page of a listing of the items `ids` (in order): `query.limit` of them after the item `query.after`, newest
    first unless `query.order` is `asc`; only the page's are read (`item_of` an id). `positions`: each item's place in
    that order, of every item the owner has held (deleted ones too: a page goes on after a deleted item from where it
    was); an `after` it never held is a 400 naming `owner`, what holds the items."""
    after = None if query.after is None else positions.get(query.after)
    if query.after is not None and after is None:
        raise invalid_request(f"after: no item '{query.after}' in {owner}", param="after")
    if query.order == "asc":
        start = 0 if after is None else bisect_right(ids, after, key=positions.__getitem__)
        page, has_more = ids[start:start + query.limit], start + query.limit < len(ids)
    else:
        end = len(ids) if after is None else bisect_left(ids, after, key=positions.__getitem__)
        page, has_more = ids[max(0, end - query.limit):end][::-1], end > query.limit
    return InputItemList.of([item_of(item_id) for item_id in page], has_more=has_more)


def in_responses_terms(error: APIError) -> APIError:
    """A chat request's error (raised while planning it) naming the field as the Responses request has it."""
    if error.param is None:
        return error
    param = _responses_param(error.param.split("."))
    message = param + error.message[len(error.param):] if error.message.startswith(error.param) else error.message
    return APIError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


def _responses_param(loc: list[str]) -> str:
    """A chat field's path under the Responses API's names (its function tools and json_schema format are flat: no
    `function` or `json_schema` level)."""
    loc = [_RESPONSES_NAME.get(loc[0], loc[0]), *loc[1:]]
    if loc[0] == "tools" and loc[2:3] == ["function"]:
        del loc[2]
    elif loc[0] == "text.format" and loc[1:2] == ["json_schema"]:
        del loc[1]
    return ".".join(loc)
