"""One HTTP request's engine work: submitting it, reading its increments, measuring it, and cleaning up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Literal, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from sluice.batching.engine import Engine
from sluice.batching.outputs import Collector, Increment, Usage
from sluice.batching.sampling_params import ContextLengthExceeded, RequestRejected, SamplingParams
from sluice.batching.structured import InvalidGrammar

from sluice.app.errors import APIError, generation_failed, internal_error, invalid_grammar
from sluice.app.metrics import ServerMetrics
from sluice.app.state import Admission, ServerState
from sluice.app.streaming import EventStreamResponse, cancel_on_disconnect

Outcome = Literal["success", "error", "abort"]

logger = logging.getLogger(__name__)


class Generation:
    """The engine request behind one HTTP request (all its prompts and samples, one collector).

    `increments()` yields them as they come; an engine error raises a 500 `APIError`, a server-side abort a
    503. `close()` is idempotent and must run in every case, by whoever reads the increments, once done reading: it
    aborts the engine request if it is unfinished (freeing its KV pages), releases the admission, and records the
    end-to-end latency by outcome; a stream closes with `close_stream()`. `cancel()` (a background response's)
    only aborts: the reader sees the abort, marked `cancelled`, and still closes.
    Latencies count from `arrival`, the moment the HTTP request reached its route.
    """

    def __init__(self, engine: Engine, collector: Collector, admission: Admission, metrics: ServerMetrics,
                 arrival: float, stall_timeout_s: float | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._engine = engine
        self._collector = collector
        self._admission = admission
        self._metrics = metrics
        self._arrival = arrival
        self._outcome: Outcome = "abort"
        self._failure: APIError | None = None
        self._closed = False
        self.cancelled = False

    @property
    def usage(self) -> Usage | None:
        return self._collector.usage

    async def increments(self) -> AsyncGenerator[Increment, None]:
        last_seen: dict[int, float] = {}
        async for increment in self._collector:
            if increment.finish_reason == "error":
                self._outcome = "error"
                self._failure = generation_failed(f"generation failed: {increment.error}")
                raise self._failure
            if increment.finish_reason == "abort":
                self._failure = APIError(503, "The request was aborted by the server", type="server_error",
                                         code="aborted")
                raise self._failure
            if increment.token_ids:
                now = time.perf_counter()
                if not last_seen:
                    self._metrics.first_token(now - self._arrival)
                previous = last_seen.get(increment.choice)
                if previous is not None:
                    self._metrics.inter_token((now - previous) / len(increment.token_ids))
                last_seen[increment.choice] = now
            yield increment
        self._outcome = "success"

    def cancel(self) -> None:
        """Aborts the engine request, if unfinished, on behalf of the client: its increments then end in the abort
        (a 503 `APIError`), which its reader tells from the server's by `cancelled`."""
        self.cancelled = True
        self._abort()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abort()
        self._admission.release()
        self._metrics.finished(self._outcome, time.perf_counter() - self._arrival)

    def _abort(self) -> None:
        if not self._collector.finished:
            self._engine.abort(self._collector.request_id)

    def stalled(self) -> None:
        """The stream's reader accepted nothing for `stall_timeout_s`: counted, and reported when it closes."""
        self._failure = APIError(408, f"The client read nothing for {self.stall_timeout_s:g} s", code="stream_stalled")
        self._metrics.stream_stalled()
        logger.warning("request %s: the client read nothing for %g s; aborted", self._collector.request_id,
                       self.stall_timeout_s)

    async def streamed(self, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """`events`, this generation's stream (closed with it). A stream that runs out before its generation did was
        ended by its builder's failure (a bug, which the builder sent the client as a 500 error event), not by the
        client: it is reported as that 500."""
        async with aclosing(events):
            async for event in events:
                yield event
        if self._outcome == "abort" and self._failure is None:
            self.building_failed()

    def building_failed(self) -> None:
        """Building its response raised (a bug): the request ended as a 500, whatever its engine request did."""
        self._outcome = "error"
        self._failure = internal_error()

    async def close_stream(self) -> None:
        """`close`, and a failure reported: after a stream's 200 it reached the client as an error event or
        not at all (the client left), which the per-status request counts never see."""
        await self.close()
        if self._outcome == "success":
            return
        failure = self._failure or APIError(499, "The client closed the stream")
        self._metrics.stream_failed(failure.status, self._collector.request_id, failure.message)


async def start_generation(request: Request, state: ServerState, prompts: list[list[int]], params: SamplingParams,
                           request_id: str, arrival: float, model: str | None, prompt_param: str | None = None,
                           grammar_param: str | None = None) -> Generation:
    """Admits the request (429/503) and submits it to the engine, with the LoRA adapter its `model` names if it
    names one (400 if it can never run; `prompt_param`: the
    request's field that holds the prompt, which a prompt too long for the context names; `grammar_param`: the
    one that holds the grammar of `params.structured`, which a grammar that does not compile names).

    Submitting builds the request (a structured output's grammar, the prompt's n-gram index, stop checkers),
    which can take seconds, so it runs in a worker thread while the event loop serves everyone else. A client
    that leaves meanwhile gets a 499, and its request is aborted as soon as it is built.
    """
    engine = state.require_engine()
    params = replace(params, lora=state.lora(model))
    admission = state.admit(len(prompts) * params.n)
    collector = Collector(request_id, len(prompts) * params.n)  # on the loop, where its increments arrive
    submitting = asyncio.ensure_future(asyncio.to_thread(engine.submit, prompts, params, collector, request_id))
    try:
        # Shielded: cancelling the wait cannot stop the thread, so the submission is seen through to its end.
        await cancel_on_disconnect(request, asyncio.shield(submitting))
    except RequestRejected as error:
        admission.release()
        raise rejected(error, params, prompt_param, grammar_param) from None
    except BaseException:
        submitting.add_done_callback(lambda _: abandon(engine, submitting, request_id, admission))
        raise
    return Generation(engine, collector, admission, state.metrics, arrival,
                      state.settings.stream_stall_timeout_s or None)


def rejected(error: RequestRejected, params: SamplingParams, prompt_param: str | None,
             grammar_param: str | None) -> APIError:
    """A request the engine can never run, as a 400; one too long for the context, or whose JSON schema does not
    compile, with OpenAI's code for it (which clients and agent CLIs match)."""
    if isinstance(error, InvalidGrammar) and grammar_param is not None:
        return invalid_grammar(str(error), grammar_param, params.structured.kind == "json_schema")
    param = prompt_param if error.param == "prompt" else error.param
    code = "context_length_exceeded" if isinstance(error, ContextLengthExceeded) else None
    return APIError(400, str(error), param=param, code=code)


def abandon(engine: Engine, submitting: asyncio.Future[None], request_id: str, admission: Admission) -> None:
    """Once a submission nobody waits for has ended: aborts the request if it reached the engine, and releases
    its admission either way."""
    if not submitting.cancelled() and submitting.exception() is None:
        engine.abort(request_id)
    admission.release()


class ResponseBuilder(Protocol):
    """Shapes a generation into one OpenAI response (`collect`) or its SSE events (`events`)."""

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]: ...

    async def collect(self, generation: Generation) -> BaseModel: ...


async def respond(request: Request, generation: Generation, builder: ResponseBuilder, stream: bool,
                  keepalive_s: float, on_close: Callable[[], None] = lambda: None) -> Response:
    """An SSE stream or one JSON body; either way the generation is closed at the end, then `on_close` runs (a
    stream's once it has closed: read to its end, or left by its client)."""
    if stream:
        async def close_stream() -> None:
            try:
                await generation.close_stream()
            finally:
                on_close()

        return EventStreamResponse(generation.streamed(builder.events(generation)), on_close=close_stream,
                                   keepalive_s=keepalive_s, stall_timeout_s=generation.stall_timeout_s,
                                   on_stall=generation.stalled)
    try:
        response = await cancel_on_disconnect(request, builder.collect(generation))
    except APIError:  # the client left (499), or the generation failed: its outcome is known
        raise
    except Exception:
        generation.building_failed()
        raise
    finally:
        try:
            await generation.close()
        finally:
            on_close()
    return Response(response.model_dump_json(), media_type="application/json")
