"""Background responses of the Responses API (`background: true`), as the official `openai` client uses them: created
at once and polled, cancelled, streamed and resumed after a dropped connection, and drained on SIGTERM. The app runs
in-process under uvicorn on a real socket (a client can leave mid-stream) over a tiny random model with SmolLM2's
tokenizer (greedy: a reply runs to its max_output_tokens), draining as `sluice serve` does."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import httpx
import openai
import pytest
import uvicorn

from test_openai_client import CONFIG, tiny_engine, tool_engine  # noqa: F401 - a fixture
from test_server_engine import fail_next_dispatch

from sluice.app.ingress import routing
from sluice.app.response_ids import new_id, replica_of
from sluice.app.serve import DrainingServer
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.engine import Engine

MODEL = "tiny"
SHORT = {"model": MODEL, "input": "Name a colour.", "temperature": 0, "max_output_tokens": 6}
LONG = {**SHORT, "max_output_tokens": 80}


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    return tiny_engine(smollm2, CONFIG)


def serve(engine: Engine, scenario, drain_timeout_s: float = 30.0, replica: str = ""):
    """Runs `scenario(client, state, server)`, an `openai.AsyncOpenAI` on the app served by a `DrainingServer` (as
    the replica `replica`, if given), and then stops the server (unless the scenario drained it); returns what the
    scenario returned, once no task is left but this one."""

    async def run():
        state = ServerState(ServerSettings(served_model_name=MODEL, ui=False), replica)
        state.set_engine(engine)
        await engine.start()  # the app's lifespan stops it
        listener = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(create_app(state), log_level="warning", timeout_graceful_shutdown=5)
        server = DrainingServer(config, state, drain_timeout_s)
        serving = asyncio.ensure_future(server.serve([listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        base_url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        try:
            async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60) as client:
                result = await scenario(client, state, server)
        finally:
            if not state.draining:
                server.should_exit = True
            await serving
        await asyncio.sleep(0)  # tasks that ended with the server return
        assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []
        return result

    return asyncio.run(run())


def slow_steps(engine: Engine, monkeypatch, step_s: float = 0.02) -> None:
    """Each engine step takes `step_s` more (a long reply's generation then lasts long enough to be cancelled, left or
    drained mid-way; the tiny model's steps take about a millisecond)."""
    real = engine.runner.dispatch

    def slow(*args):
        time.sleep(step_s)
        return real(*args)

    monkeypatch.setattr(engine.runner, "dispatch", slow)


async def finished(client: openai.AsyncOpenAI, response_id: str, timeout_s: float = 60):
    """The response, polled until it is neither queued nor in progress."""
    deadline = time.monotonic() + timeout_s
    while (response := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        await asyncio.sleep(0.05)
    return response


async def writing(client: openai.AsyncOpenAI, response_id: str):
    """The running response, polled until its output has some text."""
    while not (response := await client.responses.retrieve(response_id)).output_text:
        assert response.status in ("queued", "in_progress"), response
        await asyncio.sleep(0.02)
    return response


async def writing_on_a_conversation(client: openai.AsyncOpenAI):
    """A new conversation, and a long background response on it, polled until its output has some text."""
    conversation = await client.conversations.create()
    created = await client.responses.create(background=True, conversation=conversation.id, **LONG)
    await writing(client, created.id)
    return conversation, created


async def pages_freed(engine: Engine, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while engine.stats.kv_pages_used and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return engine.stats.kv_pages_used == 0


def test_a_background_response_answers_queued_then_polls_to_the_foreground_output(engine):
    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **SHORT)
        return created, await finished(client, created.id), await client.responses.create(**SHORT)

    created, done, foreground = serve(engine, scenario)
    assert created.status == "queued" and created.background and created.output == []
    assert done.status == "incomplete" and done.background and done.usage.output_tokens == 6
    assert done.output_text == foreground.output_text != "" and not foreground.background


def test_cancelling_a_running_background_response_aborts_it_and_the_server_serves_on(engine, monkeypatch):
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **LONG)
        running = await writing(client, created.id)
        cancelled = await client.responses.cancel(created.id)
        freed = await pages_freed(engine)
        again = await client.responses.cancel(created.id)
        return running, cancelled, freed, again, await client.responses.create(**SHORT)

    running, cancelled, freed, again, after = serve(engine, scenario)
    assert running.status == "in_progress"
    assert cancelled.status == "cancelled" and cancelled.error is None and freed
    assert cancelled.usage is None and cancelled.output_text.startswith(running.output_text)
    assert again == cancelled  # idempotent: an ended response is answered as it is
    assert after.status == "incomplete" and after.usage.output_tokens == 6


def test_a_response_cancelled_mid_call_is_stored_cancelled_and_continues_without_the_unfinished_call(tool_engine,
                                                                                                     monkeypatch):
    """Its call's arguments so far are no JSON object, and no output can answer it."""
    slow_steps(tool_engine, monkeypatch)
    story = {"type": "function", "name": "write_story", "parameters": {
        "type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}}

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, tools=[story], tool_choice="required", **LONG)
        while not (running := await client.responses.retrieve(created.id)).output:
            await asyncio.sleep(0.02)
        cancelled = await client.responses.cancel(created.id)
        return running, cancelled, await client.responses.create(previous_response_id=created.id, **SHORT)

    running, cancelled, continued = serve(tool_engine, scenario)
    assert running.status == "in_progress" and running.output[0].type == "function_call"
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "in_progress"
    assert continued.status == "incomplete"


def test_a_finished_background_response_is_cancelled_as_it_is(engine):
    async def scenario(client, state, server):
        done = await finished(client, (await client.responses.create(background=True, **SHORT)).id)
        return done, await client.responses.cancel(done.id)

    done, cancelled = serve(engine, scenario)
    assert cancelled == done and done.status == "incomplete"


def test_a_streamed_background_response_left_mid_stream_runs_on_and_resumes_after_a_sequence_number(engine,
                                                                                                  monkeypatch):
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        stream = await client.responses.create(background=True, stream=True, **LONG)
        seen = []
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 5:
                break
        await stream.close()  # the connection is dropped
        resumed = [event async for event in await client.responses.retrieve(
            seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number)]
        return seen, resumed, await client.responses.retrieve(seen[0].response.id)

    seen, resumed, stored = serve(engine, scenario)
    assert [e.type for e in seen[:2]] == ["response.created", "response.in_progress"]
    assert (seen[0].response.status, seen[1].response.status) == ("queued", "in_progress")
    numbers = [e.sequence_number for e in seen + resumed]
    assert numbers == list(range(len(numbers)))  # exactly the events after the last one seen
    assert resumed[-1].type == "response.incomplete" and stored.usage.output_tokens == 80
    text = "".join(e.delta for e in seen + resumed if e.type == "response.output_text.delta")
    assert text == resumed[-1].response.output_text == stored.output_text


def test_a_cancelled_streamed_background_response_ends_its_events_with_it_cancelled(engine, monkeypatch):
    """The live stream, a follower and the replay all end with a `response.incomplete` carrying the cancelled
    response (the client's event union has no `response.cancelled`), not on a delta nor with a failure."""
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        stream = await client.responses.create(background=True, stream=True, **LONG)
        events = [await anext(stream) for _ in range(5)]
        response_id = events[0].response.id
        follower = await client.responses.retrieve(response_id, stream=True, starting_after=2)
        cancelled = await client.responses.cancel(response_id)
        live = events + [event async for event in stream]
        followed = [event async for event in follower]
        return live, followed, [event async for event in await client.responses.retrieve(response_id, stream=True)], \
            cancelled

    live, followed, replayed, cancelled = serve(engine, scenario)
    assert cancelled.status == "cancelled" and cancelled.error is None
    for events in (live, followed, replayed):
        assert events[-1].type == "response.incomplete" and events[-1].response == cancelled
    assert followed == live[3:] and replayed == live
    assert "".join(e.delta for e in live if e.type == "response.output_text.delta") == cancelled.output_text


def test_a_cancel_releases_the_admission_only_once_the_response_is_stored_cancelled(engine, monkeypatch):
    """The run's task alone closes its generation, after storing it: a drain cannot end before the cancel's state."""
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **LONG)
        await writing(client, created.id)

        async def stored_once_idle() -> str:
            await state.wait_idle(30)
            return state.responses.get(created.id).response_json

        once_idle = asyncio.ensure_future(stored_once_idle())
        await asyncio.sleep(0)  # waiting for idle before the cancel
        await client.responses.cancel(created.id)
        return await once_idle

    assert '"status":"cancelled"' in serve(engine, scenario)


def test_an_ended_streamed_background_response_replays_its_events_from_the_store(engine):
    async def scenario(client, state, server):
        streamed = [event async for event in await client.responses.create(background=True, stream=True, **SHORT)]
        replayed = [event async for event in await client.responses.retrieve(streamed[0].response.id, stream=True)]
        after = [event async for event in await client.responses.retrieve(streamed[0].response.id, stream=True,
                                                                          starting_after=3)]
        return streamed, replayed, after

    streamed, replayed, after = serve(engine, scenario)
    assert replayed == streamed and after == streamed[4:]


def test_a_background_response_must_be_stored(engine):
    async def scenario(client, state, server):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(background=True, store=False, **SHORT)
        return caught.value.body

    error = serve(engine, scenario)
    assert error["param"] == "background" and "store" in error["message"]


def test_cancelling_a_response_not_run_in_the_background_is_a_400_and_an_unknown_one_a_404(engine):
    async def scenario(client, state, server):
        foreground = await client.responses.create(**SHORT)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.cancel(foreground.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.cancel("resp_unknown")
        return refused.value.body, unknown.value.body

    refused, unknown = serve(engine, scenario)
    assert refused["message"] == "Cannot cancel a synchronous response."
    assert unknown["code"] == "response_not_found"


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background-unstreamed"])
def test_only_a_background_response_created_streaming_is_streamed_again(engine, background):
    """OpenAI's limit; the JSON body would otherwise be read as an empty stream."""
    async def scenario(client, state, server):
        created = await client.responses.create(background=background, **SHORT)
        await finished(client, created.id)
        with pytest.raises(openai.BadRequestError) as caught:
            [event async for event in await client.responses.retrieve(created.id, stream=True)]
        return caught.value.body

    assert serve(engine, scenario)["param"] == "stream"


def test_an_engine_failure_stores_the_background_response_failed_with_its_error(engine, monkeypatch):
    async def scenario(client, state, server):
        fail_next_dispatch(engine, monkeypatch)
        return await finished(client, (await client.responses.create(background=True, **SHORT)).id)

    failed = serve(engine, scenario)
    assert failed.status == "failed" and "injected device fault" in failed.error.message


def test_a_drain_waits_for_a_background_response_to_end(engine):
    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **SHORT)
        server.handle_exit(signal.SIGTERM, None)
        return created.id, state

    response_id, state = serve(engine, scenario)
    assert '"status":"incomplete"' in state.responses.get(response_id).response_json


def test_a_background_response_running_when_the_drain_ends_is_stored_failed(engine, monkeypatch):
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **LONG)
        await writing(client, created.id)
        server.handle_exit(signal.SIGTERM, None)
        return created.id, state

    response_id, state = serve(engine, scenario, drain_timeout_s=0.1)
    stored = state.responses.get(response_id).response_json
    assert '"status":"failed"' in stored and '"code":"server_error"' in stored and len(state.background) == 0
    assert "aborted by the server" in stored


def test_a_background_response_adds_its_turn_to_its_conversation_once_ended_and_a_cancelled_one_nothing(engine,
                                                                                                         monkeypatch):
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        conversation, created = await writing_on_a_conversation(client)
        await client.responses.cancel(created.id)
        after_cancel = (await client.conversations.items.list(conversation.id)).data
        done = await finished(client, (await client.responses.create(background=True, conversation=conversation.id,
                                                                     **SHORT)).id)
        return after_cancel, done, (await client.conversations.items.list(conversation.id, order="asc")).data

    after_cancel, done, items = serve(engine, scenario)
    assert after_cancel == [] and done.status == "incomplete"
    assert [(item.role, item.content[0].text) for item in items] == [("user", SHORT["input"]),
                                                                    ("assistant", done.output_text)]


def test_a_failed_response_adds_nothing_to_its_conversation(engine, monkeypatch):
    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        fail_next_dispatch(engine, monkeypatch)
        created = await client.responses.create(background=True, conversation=conversation.id, **SHORT)
        return await finished(client, created.id), (await client.conversations.items.list(conversation.id)).data

    failed, items = serve(engine, scenario)
    assert failed.status == "failed" and items == []


def test_a_failed_streamed_response_frees_its_conversation_before_its_last_event_and_is_stored_failed(engine,
                                                                                                        monkeypatch):
    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        fail_next_dispatch(engine, monkeypatch)
        stream = await client.responses.create(conversation=conversation.id, stream=True, **SHORT)
        async for event in stream:
            if event.type == "response.failed":
                free_at_last_event = state.conversations.occupy(conversation.id)
                state.conversations.free(conversation.id)
        stored = await client.responses.retrieve(event.response.id)
        items = (await client.conversations.items.list(conversation.id)).data
        return free_at_last_event, stored, items, await client.responses.create(conversation=conversation.id, **SHORT)

    free_at_last_event, stored, items, next_turn = serve(engine, scenario)
    assert free_at_last_event and stored.status == "failed" and "injected device fault" in stored.error.message
    assert items == [] and next_turn.status == "incomplete"


LOCKED = {"message": "Another process is currently operating on this conversation. Please retry in a few seconds.",
          "type": "invalid_request_error", "param": "conversation", "code": "conversation_locked"}


async def refused_while_it_runs(client: openai.AsyncOpenAI, conversation_id: str) -> dict:
    """The error of a second response on the conversation, which one runs on."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(conversation=conversation_id, **SHORT)
    return caught.value.body


def test_a_second_response_on_a_conversation_while_one_runs_is_openais_conversation_locked(engine, monkeypatch):
    """One at a time, each seeing the turns before it; the next runs once the first has ended, here cancelled."""
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        conversation, created = await writing_on_a_conversation(client)
        refused = await refused_while_it_runs(client, conversation.id)
        await client.responses.cancel(created.id)
        return refused, await client.responses.create(conversation=conversation.id, **SHORT)

    refused, after_cancel = serve(engine, scenario)
    assert refused == LOCKED and after_cancel.status == "incomplete"


def test_a_conversation_is_free_once_its_foreground_response_has_ended_whole_or_streamed(engine, monkeypatch):
    slow_steps(engine, monkeypatch)
    medium = {**SHORT, "max_output_tokens": 20}  # three turns fit the tiny model's 128 tokens

    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        outcomes = []
        for stream in (False, True):
            running = asyncio.ensure_future(client.responses.create(conversation=conversation.id, stream=stream,
                                                                    **medium))
            deadline = time.monotonic() + 30
            while await state.wait_idle(0):  # until it runs
                assert time.monotonic() < deadline and not running.done(), running
                await asyncio.sleep(0.01)
            outcomes.append(await refused_while_it_runs(client, conversation.id))
            reply = await running
            outcomes.append([event async for event in reply][-1].response.status if stream else reply.status)
        items = (await client.conversations.items.list(conversation.id)).data
        return outcomes, len(items), (await client.responses.create(conversation=conversation.id, **SHORT)).status

    outcomes, num_items, last = serve(engine, scenario)
    assert outcomes == [LOCKED, "incomplete", LOCKED, "incomplete"] and num_items == 4 and last == "incomplete"


def test_a_conversation_is_free_once_the_client_of_its_streamed_response_has_left(engine, monkeypatch):
    """The stream's generation closes when the client leaves (its response never ends, nor adds a turn)."""
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        stream = await client.responses.create(conversation=conversation.id, stream=True, **LONG)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        await state.wait_idle(30)
        after = await client.responses.create(conversation=conversation.id, **SHORT)
        return after, (await client.conversations.items.list(conversation.id)).data

    after, items = serve(engine, scenario)
    assert after.status == "incomplete" and len(items) == 2


async def sizes(client: openai.AsyncOpenAI, state: ServerState) -> tuple[int, int]:
    """The store's size of an empty conversation, and what SHORT's turn adds to it (greedy: the same each time)."""
    conversation = await client.conversations.create()
    empty = state.conversations.get(conversation.id).size
    await client.responses.create(conversation=conversation.id, **SHORT)
    turn = state.conversations.get(conversation.id).size - empty
    await client.conversations.delete(conversation.id)
    return empty, turn


def test_a_response_whose_conversation_and_input_alone_exceed_the_stores_bytes_is_a_400_before_it_generates(engine):
    async def scenario(client, state, server):
        conversation = await client.conversations.create(items=[{"role": "user", "content": "Hi"}])
        state.conversations.max_bytes = state.conversations.get(conversation.id).size + 300
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(conversation=conversation.id, **{**SHORT, "input": "x" * 300})
        return conversation.id, caught.value.body, (await client.conversations.items.list(conversation.id)).data, \
            len(state.responses)

    conversation_id, error, items, num_stored = serve(engine, scenario)
    assert error["param"] == "input" and conversation_id in error["message"] and "store" in error["message"]
    assert len(items) == 1 and num_stored == 0


def test_a_turn_that_takes_the_store_past_its_bytes_evicts_other_conversations_and_is_added(engine):
    async def scenario(client, state, server):
        empty, turn = await sizes(client, state)
        other = await client.conversations.create()
        conversation = await client.conversations.create()
        state.conversations.max_bytes = empty + turn + empty - 1  # the turn fits its conversation, not the other too
        reply = await client.responses.create(conversation=conversation.id, **SHORT)
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(other.id)
        return reply, (await client.conversations.items.list(conversation.id)).data

    reply, items = serve(engine, scenario)
    assert reply.status == "incomplete" and [item.id for item in items][0] == reply.output[0].id


def test_a_turn_the_store_cannot_hold_fails_its_response_and_leaves_its_conversation_as_it_was(engine):
    """Its conversation alone would exceed the bound once the output is added: the client hears it (the last event
    `response.failed`), rather than a turn silently dropped."""
    async def scenario(client, state, server):
        empty, turn = await sizes(client, state)
        conversation = await client.conversations.create()
        state.conversations.max_bytes = empty + turn - 1
        events = [event async for event in await client.responses.create(conversation=conversation.id, stream=True,
                                                                          **SHORT)]
        stored = await client.responses.retrieve(events[-1].response.id)
        return events[-1], stored, (await client.conversations.items.list(conversation.id)).data

    last, stored, items = serve(engine, scenario)
    assert last.type == "response.failed" and last.response.status == "failed" and last.response.output_text
    assert "would exceed" in last.response.error.message and stored == last.response and items == []


def test_a_replicas_conversation_and_every_item_it_holds_name_that_replica(engine):
    """Behind --replicas a request on a conversation then goes to the replica that holds it (app/ingress.py)."""
    async def scenario(client, state, server):
        conversation = await client.conversations.create(items=[{"role": "user", "content": "Hi"}])
        await client.responses.create(conversation=conversation.id, **SHORT)
        return conversation, (await client.conversations.items.list(conversation.id)).data

    conversation, items = serve(engine, scenario, replica="r7x2")
    assert [replica_of(named.id) for named in [conversation, *items]] == ["r7x2"] * 4


def test_a_background_responses_cancel_goes_to_the_replica_that_runs_it():
    response_id = new_id("resp", "r7x2")
    assert routing(f"/v1/responses/{response_id}/cancel", b"").replica == replica_of(response_id) == "r7x2"


def test_continuing_a_background_response_still_running_is_a_400(engine, monkeypatch):
    """Its stored conversation has no output yet: continuing it would silently drop that output."""
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **LONG)
        await writing(client, created.id)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(previous_response_id=created.id, **SHORT)
        await client.responses.cancel(created.id)
        return caught.value.body

    error = serve(engine, scenario)
    assert error["param"] == "previous_response_id" and "still in progress" in error["message"]


def test_a_streamed_background_response_too_large_with_its_events_is_stored_without_them(engine):
    async def scenario(client, state, server):
        state.responses.max_bytes = 20_000  # its JSON fits, its 80 tokens' events do not
        events = [event async for event in await client.responses.create(background=True, stream=True, **LONG)]
        stored = await client.responses.retrieve(events[0].response.id)
        with pytest.raises(openai.BadRequestError) as caught:
            [event async for event in await client.responses.retrieve(stored.id, stream=True)]
        return events, stored, caught.value.body

    events, stored, error = serve(engine, scenario)
    assert stored == events[-1].response and stored.usage.output_tokens == 80
    assert error["param"] == "stream" and "no longer kept" in error["message"]


def test_starting_after_without_stream_is_a_400(engine):
    async def scenario(client, state, server):
        created = await client.responses.create(background=True, stream=True, **SHORT)
        response_id = [event async for event in created][0].response.id
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            return (await http.get(f"responses/{response_id}", params={"starting_after": 1})).json()["error"]

    error = serve(engine, scenario)
    assert error["param"] == "starting_after"


def test_a_drain_of_the_state_waits_for_a_background_response_to_be_stored(engine, monkeypatch):
    """A replica's shutdown (`SluiceReplica.__del__`) drains its state so before its engine stops."""
    slow_steps(engine, monkeypatch, step_s=0.005)

    async def scenario(client, state, server):
        created = await client.responses.create(background=True, **{**SHORT, "max_output_tokens": 20})
        drained = await state.drain(30)
        server.should_exit = True
        return drained, state.responses.get(created.id).response_json

    drained, stored = serve(engine, scenario)
    assert drained and '"status":"incomplete"' in stored


def test_an_id_a_client_gives_twice_is_openais_400_in_a_responses_input_and_a_conversations_items(engine):
    """Checked as the client sent them, before the server gives the items ids of its own."""
    twice = [{"type": "message", "id": "msg_1", "role": "user", "content": text} for text in ("Hi", "Bye")]

    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        errors = []
        for create in (lambda: client.responses.create(**{**SHORT, "input": twice}),
                       lambda: client.conversations.create(items=twice),
                       lambda: client.conversations.items.create(conversation.id, items=twice)):
            with pytest.raises(openai.BadRequestError) as caught:
                await create()
            errors.append(caught.value.body["message"])
        return errors

    duplicate = "Duplicate item found with id msg_1. Remove duplicate items from your {} and try again."
    assert serve(engine, scenario) == [duplicate.format("input"), duplicate.format("items"), duplicate.format("items")]


def test_an_id_the_server_does_not_hold_is_replaced_whatever_its_shape(engine):
    """A client's id shaped as the server's would otherwise name its item alike another's that holds it."""
    planted = {"type": "message", "id": "msg_" + "a" * 32, "role": "user", "content": "Mine."}

    async def scenario(client, state, server):
        conversation = await client.conversations.create(items=[planted])
        reply = await client.responses.create(**{**SHORT, "input": [planted]})
        return [item.id for item in [*(await client.conversations.items.list(conversation.id)).data,
                                     *(await client.responses.input_items.list(reply.id)).data]]

    ids = serve(engine, scenario)
    assert len(ids) == 2 and planted["id"] not in ids


def test_a_response_on_a_conversation_deleted_while_another_ran_on_it_is_openais_404(engine, monkeypatch):
    slow_steps(engine, monkeypatch)

    async def scenario(client, state, server):
        conversation, created = await writing_on_a_conversation(client)
        await client.conversations.delete(conversation.id)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(conversation=conversation.id, **SHORT)
        await client.responses.cancel(created.id)
        return conversation.id, caught.value.body

    conversation_id, error = serve(engine, scenario)
    assert error["message"] == f"Conversation with id '{conversation_id}' not found."


def test_a_streamed_responses_conversation_is_free_once_its_last_event_has_come(engine):
    """An agent may send its next turn at once: the stream need not have closed."""
    async def scenario(client, state, server):
        conversation = await client.conversations.create()
        async for event in await client.responses.create(conversation=conversation.id, stream=True, **SHORT):
            if event.type == "response.incomplete":
                return state.conversations.occupy(conversation.id)

    assert serve(engine, scenario)
