"""The Responses API routes: `POST /v1/responses` (served by the chat path), `POST /v1/responses/input_tokens` (its
prompt's length), `GET` / `DELETE` of a stored one, and `POST /v1/responses/{id}/cancel` of a background one.

Where a request goes: `parse_body` (`responses_api_schemas.py`) -> the earlier response's conversation, if it
continues one, and the stored items its input references (`responses_api_store.py`, held by the server state), or
the items of the Conversations API's conversation it names (`conversations.py`) -> a chat request
(`responses_api_convert.py`)
-> `plan_chat` (`routes.py`: prompt, parameters, forced calls, reasoning) -> the engine -> `responses_api_builder.py`
(the response or its events) -> the store, and its turn to its conversation; with `background: true`, through a
run of the server's (`responses_api_background.py`) that answers at once and stores the response when it ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from sluice.app.conversations import add_turn, check_turn_fits, conversation_items, holds_item, occupy, too_large
from sluice.app.errors import APIError, invalid_request
from sluice.app.generation import Generation, respond, start_generation
from sluice.app.responses_api_background import BackgroundRun, EventLog, Store, replayed
from sluice.app.response_ids import new_id
from sluice.app.responses_api_builder import ResponsesBuilder
from sluice.app.responses import TokenNames, token_logprobs
from sluice.app.responses_api_convert import (
    ITEMS,
    Items,
    chat_request,
    check_ids_distinct,
    in_responses_terms,
    item_page,
    output_items,
    stored_items,
)
from sluice.app.responses_api_schemas import (
    DeletedResponse,
    FunctionCallOutputItem,
    InputItem,
    InputItemsQuery,
    InputTokenCount,
    InputTokensRequest,
    ItemReference,
    MessageItem,
    RequestItem,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    RetrieveQuery,
)
from sluice.app.responses_api_store import StoredResponse
from sluice.app.routes import ChatPlan, json_response, parse_body, parse_query, plan_chat
from sluice.app.state import ServerState
from sluice.app.streaming import EventStreamResponse
from sluice.batching.engine import Engine
from sluice.batching.request import check_fits
from sluice.batching.sampling_params import RequestRejected


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'", code="response_not_found")


async def create_response(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, ResponsesRequest)
    free = occupy(state, body.conversation)  # once the response has ended, whichever way
    try:
        given = referenced_items(state, body.input)
        check_ids_distinct(item.id for item in given)  # as the client sent them, before they are replaced
        # Its input items' ids are given now, so that the stored response and its conversation name them alike.
        turn = stored_items(given, state.replica, partial(holds_item, state, body.conversation))
        items, plan = await _conversation_plan(state, engine, body, turn)
        check_turn_fits(state, body.conversation, turn)
        response_id = new_id("resp", state.replica)
        response = ResponseObject(
            id=response_id, created_at=int(time.time()), status="queued" if body.background else "in_progress",
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, model=state.served_name(body.model), output=[],
            parallel_tool_calls=body.parallel_tool_calls, max_tool_calls=body.max_tool_calls,
            previous_response_id=body.previous_response_id, conversation=body.conversation,
            temperature=plan.params.temperature, top_p=plan.params.top_p, top_logprobs=body.top_logprobs,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools, text=body.text, reasoning=body.reasoning, store=body.store,
            background=body.background, metadata=body.metadata, truncation=body.truncation, user=body.user,
        )

        def store(done: ResponseObject, events: tuple[bytes, ...] = ()) -> None:
            if body.store:
                conversation = stored_items(items + output_items(done.output), state.replica)
                state.responses.put(done.id, StoredResponse(
                    done.model_dump_json(), ITEMS.dump_json(conversation).decode(), len(items),
                    frozenset(item.id for item in conversation), events))

        def ended(done: ResponseObject) -> None:
            """The reply has ended (before its last event): its turn goes to its conversation unless it failed or
            was cancelled, then the response to the store, unless a background run stores it (once it has ended,
            with the events it kept)."""
            if body.conversation is not None:
                if done.status in ("completed", "incomplete"):
                    _add_turn(state, body.conversation.id,
                              stored_items(turn + output_items(done.output), state.replica), done)
                free()  # before the client hears the response's end, which may send its next turn at once
            if not body.background:
                store(done)

        logprobs = partial(token_logprobs, TokenNames(engine.tokenizer)) if body.logprobs else None
        builder = ResponsesBuilder(response, plan.calling, ended, logprobs, plan.reasoning, engine.tokenizer)
        try:
            generation = await start_generation(request, state, [plan.prompt.token_ids], plan.params, response_id,
                                                arrival, body.model, "input", plan.grammar_field)
        except APIError as error:
            raise in_responses_terms(error) from None
    except BaseException:
        free()
        raise
    if body.background:
        run = BackgroundRun(response, EventLog() if body.stream else None, generation)
        return _run_in_background(state, run, generation.streamed(builder.events(generation)), store, free)
    return await respond(request, generation, builder, body.stream, state.settings.sse_keepalive_s, on_close=free)


def _add_turn(state: ServerState, conversation_id: str, turn: Items, done: ResponseObject) -> None:
    """Adds a completed or incomplete response's `turn` to its conversation; one the store cannot hold fails the
    response (its error says why) rather than being dropped unseen."""
    if not add_turn(state, conversation_id, turn):
        done.status = "failed"
        done.error = ResponseError(code="server_error", message=f"The response's turn was not added to its "
                                                                f"conversation: {too_large(conversation_id)}")


def _run_in_background(state: ServerState, run: BackgroundRun, events: AsyncGenerator[bytes, None],
                       store: Store, free: Callable[[], None]) -> Response:
    """Starts `run` (stored at once, queued) and answers with the response as created, or with its events from the
    first, which the client may leave without stopping it; `free` once it has ended."""
    store(run.response)
    state.background.start(run, events, store, free)  # its task first runs once this has returned: still queued
    if run.log is None:
        return json_response(run.response)
    return _event_stream(state, run.log.after(None))


def _event_stream(state: ServerState, events: AsyncGenerator[bytes, None]) -> Response:
    """A background response's events, for a client that follows it (leaving stops nothing)."""
    return EventStreamResponse(events, on_close=_nothing, keepalive_s=state.settings.sse_keepalive_s,
                               stall_timeout_s=state.settings.stream_stall_timeout_s or None)


async def _nothing() -> None:
    pass


async def count_input_tokens(request: Request) -> Response:
    """`POST /v1/responses/input_tokens`: the length of the prompt `/v1/responses` would give the model for the
    same request (its conversation, instructions and tools; its oldest turns dropped as `truncation: "auto"`
    would)."""
    state, engine, body = await parse_body(request, InputTokensRequest)
    _, plan = await _conversation_plan(state, engine, body, referenced_items(state, body.input))
    return json_response(InputTokenCount(input_tokens=len(plan.prompt.token_ids)))


async def _conversation_plan(state: ServerState, engine: Engine, body: ResponsesRequest, turn: Items
                             ) -> tuple[Items, ChatPlan]:
    """The request's whole conversation (an earlier response's or a conversation's items, then `turn`, its input
    with references resolved) and the plan of the chat request it becomes, after `truncation: "auto"` where it does
    not fit."""
    items = earlier_items(state, body.previous_response_id) + conversation_items(state, body.conversation) + turn
    plan = await _plan(state, engine, body, items)
    if body.truncation == "auto" and not _fits(engine, plan):
        items, plan = await _fitting_conversation(state, engine, body, items, plan)
    return items, plan


async def _plan(state: ServerState, engine: Engine, body: ResponsesRequest, items: Items) -> ChatPlan:
    try:
        return await plan_chat(state, engine, chat_request(body, items))
    except APIError as error:
        raise in_responses_terms(error) from None


def _fits(engine: Engine, plan: ChatPlan) -> bool:
    """Whether the plan's prompt, with the tokens it may add, fits the context (and the KV pool)."""
    try:
        check_fits([plan.prompt.token_ids], plan.params, engine.limits)
    except RequestRejected:
        return False
    return True


async def _fitting_conversation(state: ServerState, engine: Engine, body: ResponsesRequest, items: Items,
                                plan: ChatPlan) -> tuple[Items, ChatPlan]:
    """`truncation: "auto"` for `items`, whose `plan` does not fit the context: the conversation with the fewest of
    its oldest steps dropped whose plan fits, found by bisection (fewer items never make a longer prompt). Its
    opening stays (up to its first user message, the task; without one, its system and developer messages), and
    steps go whole: one starts at a user message, or
    where the model acts again after its calls' outputs, so no call loses its output nor an output its call. Where
    even the opening and the last step do not fit, those, for the engine to refuse."""
    head = next((i + 1 for i, item in enumerate(items) if _is_user_message(item)),
                next((i for i, item in enumerate(items) if not _is_instruction(item)), len(items)))
    cuts = [items[:head] + items[i:] for i in range(head + 1, len(items)) if _starts_step(items[i - 1], items[i])]
    if not cuts:
        return items, plan
    low, high = 0, len(cuts) - 1  # the first fitting cut, if any, is at `high` or before it
    plans = {high: await _plan(state, engine, body, cuts[high])}
    while low < high:
        middle = (low + high) // 2
        plans[middle] = await _plan(state, engine, body, cuts[middle])
        if _fits(engine, plans[middle]):
            high = middle
        else:
            low = middle + 1
    return cuts[high], plans[high]


def _is_user_message(item: InputItem) -> bool:
    return isinstance(item, MessageItem) and item.role == "user"


def _is_instruction(item: InputItem) -> bool:
    return isinstance(item, MessageItem) and item.role in ("system", "developer")


def _starts_step(before: InputItem, item: InputItem) -> bool:
    """Whether a step of the conversation starts at `item`: a user's message, or the model's first item after the
    outputs of its calls."""
    return _is_user_message(item) or (isinstance(before, FunctionCallOutputItem)
                                      and not isinstance(item, FunctionCallOutputItem))


def earlier_items(state: ServerState, response_id: str | None) -> Items:
    """The conversation a stored response ended (its input, then its output); none without `response_id`. One
    still running in the background has no output yet: a 400, rather than a continuation without it."""
    if response_id is None:
        return []
    if state.background.get(response_id) is not None:
        raise APIError(400, f"Previous response with id '{response_id}' is still in progress.",
                       param="previous_response_id", code="previous_response_in_progress")
    stored = state.responses.get(response_id)
    if stored is None:
        # OpenAI's 400 (not a 404: the request's field is wrong), whose code clients match to send the whole
        # conversation again.
        raise APIError(400, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return ITEMS.validate_json(stored.items_json)


def referenced_items(state: ServerState, items: list[RequestItem]) -> Items:
    """`items` with each item reference replaced by the stored item it names; one naming none is a 400."""
    return [_stored_item(state, item.id) if isinstance(item, ItemReference) else item for item in items]


def _stored_item(state: ServerState, item_id: str) -> InputItem:
    stored = state.responses.holding(item_id)
    if stored is None:
        raise invalid_request(f"item_reference: no stored item with id '{item_id}'", param="input")
    return next(item for item in ITEMS.validate_json(stored.items_json) if item.id == item_id)


async def get_response(request: Request) -> Response:
    """A stored response; one running in the background as it is now. With `stream`, the events of a background
    response created with `stream: true` (`RetrieveQuery`)."""
    response_id = request.path_params["response_id"]
    state = _state(request)
    query = parse_query(request, RetrieveQuery)
    if query.stream:
        return _event_stream(state, _events_after(state, response_id, query.starting_after))
    if (run := state.background.get(response_id)) is not None:
        return json_response(run.response)
    return Response(_stored(state, response_id).response_json, media_type="application/json")


def _events_after(state: ServerState, response_id: str, starting_after: int | None) -> AsyncGenerator[bytes, None]:
    """The events after `starting_after` of a streamed background response: a running one's as they come, an ended
    one's as stored; a response that kept none is a 400 (OpenAI's limit: only those created with `stream: true`)."""
    run = state.background.get(response_id)
    if run is not None and run.log is not None:
        return run.log.after(starting_after)
    stored = _stored(state, response_id)
    if stored.events:
        return replayed(stored.events, starting_after)
    if stored.events_dropped:
        raise invalid_request(f"stream: the events of response '{response_id}' are no longer kept (with them it "
                              "exceeded the store's --responses-store-bytes)", param="stream")
    raise invalid_request("stream: only a background response created with stream: true is streamed again",
                          param="stream")


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: a background response still running is stopped (its engine request
    aborted) and stored as cancelled; one that has ended is answered as it is (cancelling is idempotent, as
    OpenAI's); a response that did not run in the background is a 400, as vLLM's."""
    response_id = request.path_params["response_id"]
    state = _state(request)
    if (run := state.background.get(response_id)) is not None:
        await run.cancel()
    stored = _stored(state, response_id)
    if not ResponseObject.model_validate_json(stored.response_json).background:
        raise invalid_request("Cannot cancel a synchronous response.")
    return Response(stored.response_json, media_type="application/json")


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise response_not_found(response_id)
    return stored


async def list_input_items(request: Request) -> Response:
    """The items the response was given: its conversation before its output (an earlier response's included),
    `limit` at a time after the item `after`, newest first unless `order` is `asc`."""
    response_id = request.path_params["response_id"]
    query = parse_query(request, InputItemsQuery)
    stored = _stored(_state(request), response_id)
    items = {item.id: item for item in ITEMS.validate_json(stored.items_json)[:stored.input_count]}
    ids = list(items)
    return json_response(item_page(ids, {item_id: index for index, item_id in enumerate(ids)}, items.__getitem__,
                                   query, f"the input of response '{response_id}'"))


async def delete_response(request: Request) -> Response:
    """Deletes a stored response; one running in the background is cancelled first (else its end would store it
    again)."""
    response_id = request.path_params["response_id"]
    state = _state(request)
    if (run := state.background.get(response_id)) is not None:
        await run.cancel()
    if not state.responses.delete(response_id):
        raise response_not_found(response_id)
    return json_response(DeletedResponse(id=response_id))


def _state(request: Request) -> ServerState:
    return request.app.state.sluice
