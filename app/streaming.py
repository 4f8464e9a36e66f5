"""Server-Sent Events: framing, keep-alive comments, and noticing a client that has gone.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`, as OpenAI's does. While no event
is ready (a request waiting in the queue), a comment `: keep-alive` goes out every `keepalive_s` seconds, so
proxies and clients keep the connection; SSE clients ignore comments. A reader that accepts no send for
`stall_timeout_s` seconds (its TCP window stays full) has its stream ended, so its request stops holding KV pages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from sluice.app.errors import APIError

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict | str) -> bytes:
    """One event; a dict is sent as compact JSON, a str as it is (already-serialized JSON)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class StreamStalled(Exception):
    """The reader accepted no send for the stall timeout."""


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that stops its events as soon as the client disconnects.

    Stopping is what aborts the engine request and frees its KV pages, so it must happen when the client
    leaves, not at the next token (which may be far off for a queued request). Starlette only watches
    for the disconnect under ASGI spec < 2.4; this does it whatever the server. `on_close` runs last in
    every case, including a client gone before the first event. A send that waits more than `stall_timeout_s`
    (None: no limit) ends the stream the same way, after `on_stall`; the server then closes the connection
    (once the at most 64 KiB already written drains, asyncio's transport holds it until then).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]],
                 keepalive_s: float, stall_timeout_s: float | None = None,
                 on_stall: Callable[[], None] = lambda: None) -> None:
        self._stream = with_keepalive(events, keepalive_s)
        super().__init__(self._stream, headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_stall(message: Message) -> None:
            try:
                async with asyncio.timeout(self._stall_timeout_s):
                    await send(message)
            except TimeoutError:
                raise StreamStalled from None

        streaming = asyncio.ensure_future(self.stream_response(send_or_stall))
        watching = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            if not streaming.cancelled() and isinstance(streaming.exception(), StreamStalled):
                self._on_stall()
            # A task parked in `send` rather than inside the generators was cancelled without reaching
            # their own cleanup; close them explicitly, the outer first (it may be waiting on the inner).
            await self._stream.aclose()
            await self._events.aclose()
            await self._on_close()
        if not streaming.cancelled() and streaming.exception() is not None:
            error = streaming.exception()
            if not isinstance(error, OSError | StreamStalled):  # the client went away or stopped reading
                raise error


async def with_keepalive(events: AsyncIterator[bytes], keepalive_s: float) -> AsyncGenerator[bytes, None]:
    """`events`, with a keep-alive comment after every `keepalive_s` seconds without one.

    The pending `anext` is waited on, never cancelled: cancelling it would close the event generator.
    """
    iterator = aiter(events)
    next_event: asyncio.Future[bytes] | None = None
    try:
        while True:
            next_event = asyncio.ensure_future(anext(iterator))
            while not (await asyncio.wait({next_event}, timeout=keepalive_s))[0]:
                yield KEEPALIVE
            try:
                event = next_event.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if next_event is not None and not next_event.done():
            next_event.cancel()
            await asyncio.gather(next_event, return_exceptions=True)


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the server reports `http.disconnect` (call only after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it if the client disconnects first (then raises a 499 `APIError`)."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, watching):
            task.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working.cancelled():
        raise APIError(499, "The client closed the request", code="client_closed_request")
    return working.result()
