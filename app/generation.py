"""Drives the engine for one HTTP request: submits one engine request per prompt, merges their output
streams into one, measures latencies, and aborts whatever is unfinished when closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from batching.engine import Engine, RequestRejected
from batching.request_output import RequestOutput
from batching.sampling_params import SamplingParams

from app.disconnect import cancel_on_disconnect
from app.errors import APIError, generation_failed, invalid_request
from app.metrics import ServerMetrics
from app.prompts import Prompt
from app.sse import EventStreamResponse
from app.state import Admission


@dataclass(frozen=True)
class ChoiceOutput:
    """An engine increment, placed among the HTTP response's choices (`prompt * n + index`)."""

    choice: int
    output: RequestOutput


class _End:
    """Marks one engine stream as exhausted in the merged queue."""


class Generation:
    """The engine requests behind one HTTP request.

    Construction submits every prompt (a `RequestRejected` becomes a 400, and whatever was already
    submitted is aborted). `outputs()` yields increments from all prompts as they come; an engine error
    raises a 500 `APIError`. `close()` is idempotent and must run in every case: it stops the streams,
    aborts unfinished requests (freeing their KV pages) and releases the admission.
    """

    def __init__(
        self,
        engine: Engine,
        prompts: list[Prompt],
        params: SamplingParams,
        request_id: str,
        admission: Admission,
        metrics: ServerMetrics,
    ) -> None:
        self._engine = engine
        self._n = params.n
        self._admission = admission
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._unfinished: dict[int, set[int]] = {i: set(range(params.n)) for i in range(len(prompts))}
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._pumps: list[asyncio.Task] = []
        self._closed = False
        try:
            for prompt, engine_id in zip(prompts, self._ids):
                self._streams.append(engine.add_request(prompt.token_ids, params, engine_id))
        except RequestRejected as error:
            self._abort_unfinished()
            admission.release()
            raise invalid_request(str(error)) from None

    async def outputs(self) -> AsyncGenerator[ChoiceOutput, None]:
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | _End]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(_pump(i, stream, queue)) for i, stream in enumerate(self._streams)]
        last_seen: dict[tuple[int, int], float] = {}
        first_token_seen = False
        remaining = len(self._pumps)
        while remaining:
            prompt, item = await queue.get()
            if isinstance(item, _End):
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise generation_failed(f"generation failed: {item}")
            if item.error is not None or item.finish_reason == "error":
                raise generation_failed(f"generation failed: {item.error}")
            if item.finish_reason == "abort":
                raise APIError(503, "The request was aborted by the server", type="server_error", code="aborted")
            now = time.perf_counter()
            if item.token_ids:
                if not first_token_seen:
                    first_token_seen = True
                    self._metrics.time_to_first_token.observe(now - self._arrival)
                previous = last_seen.get((prompt, item.index))
                if previous is not None:
                    self._metrics.inter_token_latency.observe((now - previous) / len(item.token_ids))
                last_seen[(prompt, item.index)] = now
            if item.finished:
                self._unfinished[prompt].discard(item.index)
            yield ChoiceOutput(prompt * self._n + item.index, item)
        self._metrics.e2e_latency.observe(time.perf_counter() - self._arrival)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        self._abort_unfinished()
        self._admission.release()

    def _abort_unfinished(self) -> None:
        # Closing a stream aborts its request only if the stream was ever started; abort explicitly.
        for prompt, engine_id in enumerate(self._ids[: len(self._streams)]):
            if self._unfinished[prompt]:
                self._engine.abort(engine_id)


async def _pump(prompt: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    try:
        async for output in stream:
            queue.put_nowait((prompt, output))
    except Exception as error:  # an engine failure reaches the client as an error event, not a crash
        queue.put_nowait((prompt, error))
    else:
        queue.put_nowait((prompt, _End()))


class ResponseBuilder(Protocol):
    """Shapes a generation into one OpenAI response (`collect`) or its SSE events (`events`)."""

    def events(self, generation: Generation) -> AsyncIterator[str]: ...

    async def collect(self, generation: Generation) -> BaseModel: ...


async def respond(request: Request, generation: Generation, builder: ResponseBuilder, stream: bool) -> Response:
    """An SSE stream or one JSON body; either way the generation is closed (its requests aborted) at the end."""
    if stream:
        return EventStreamResponse(builder.events(generation), on_close=generation.close)
    try:
        response = await cancel_on_disconnect(request, builder.collect(generation))
    finally:
        await generation.close()
    return Response(response.model_dump_json(), media_type="application/json")
