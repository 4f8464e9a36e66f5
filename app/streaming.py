"""Server-Sent Events: framing, keep-alive comments, and noticing a client that has gone.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`, as OpenAI's does. While no event
is ready (a request waiting in the queue), a comment `: keep-alive` goes out every `keepalive_s` seconds, so
proxies and clients keep the connection; SSE clients ignore comments. A reader that accepts no send for
`stall_timeout_s` seconds (its TCP window stays full) has its stream ended, so its request stops holding KV pages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from sluice.app.errors import APIError

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TextFrame:
    """An event that recurs with only a text changing (a stream's text deltas): the bytes around the text are
    serialized once, from the event built by `event_with(mark)`, and each event then serializes its text alone."""

    _MARK = "\ue000sluice-text\ue000"  # no id, model or name holds it

    def __init__(self, event_with: Callable[[str], bytes]) -> None:
        self._head, self._tail = event_with(self._MARK).split(to_json(self._MARK))

    def event(self, text: str) -> bytes:
        return self._head + to_json(text) + self._tail


def sse_event(payload: dict | str) -> bytes:
    """One event; a dict is sent as compact JSON, a str as it is (already-serialized JSON)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that stops its events as soon as the client disconnects.

    Stopping is what aborts the engine request and frees its KV pages, so it must happen when the client
    leaves, not at the next token (which may be far off for a queued request). Starlette only watches
    for the disconnect under ASGI spec < 2.4; this does it whatever the server. `on_close` runs last in
    every case, including a client gone before the first event. A send that waits more than `stall_timeout_s`
    (None: no limit) ends the stream the same way, after `on_stall`; the server then closes the connection
    (once the at most 64 KiB already written drains, asyncio's transport holds it until then).

    Keep-alive comments and the stall limit hang off one timer per stream, re-armed only when it fires: at
    hundreds of streams and a token per stream every few milliseconds, a timer or a task per event cost the
    event loop about a third of its time (RESULTS.md, 2026-11-27). A comment is sent only while the stream
    waits for its next event; if that event comes while the comment's send is still blocked (a full socket),
    the two sends queue on the transport in the order they began.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]],
                 keepalive_s: float, stall_timeout_s: float | None = None,
                 on_stall: Callable[[], None] = lambda: None) -> None:
        super().__init__(events, headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close
        self._keepalive_s = keepalive_s
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        link = _Link(send, self._keepalive_s, self._stall_timeout_s)
        streaming = asyncio.ensure_future(self._stream(link))
        watching = asyncio.ensure_future(wait_for_disconnect(receive))
        link.watch(streaming)
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await link.close()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            if link.stalled:
                self._on_stall()
            # A task parked in `send` rather than inside the generator was cancelled without reaching its
            # own cleanup; close it explicitly.
            await self._events.aclose()
            await self._on_close()
        if not streaming.cancelled() and streaming.exception() is not None:
            error = streaming.exception()
            if not isinstance(error, OSError):  # the client went away
                raise error

    async def _stream(self, link: _Link) -> None:
        await link.send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            await link.body(event)
        link.finishing = True
        await link.send({"type": "http.response.body", "body": b"", "more_body": False})


class _Link:
    """One stream's sends, timed: when the last one ended, and since when the oldest still blocked began.

    Every send is timed, the response's start and its empty last body too: the server waits for a full socket to
    drain before any send (uvicorn does), so a reader that stops as the last events go out (a Responses stream's
    last event carries the whole response) blocks the last send, which must end at the stall limit as others do.
    """

    def __init__(self, send: Send, keepalive_s: float, stall_timeout_s: float | None) -> None:
        self._send = send
        self.stalled = False
        self.finishing = False
        self._keepalive_s = keepalive_s
        self._stall_timeout_s = stall_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last_sent = self._loop.time()
        self._blocked_since = 0.0
        self._num_sending = 0
        self._streaming: asyncio.Task | None = None
        self._keepalive: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, streaming: asyncio.Task) -> None:
        """Starts the timer: keep-alive comments while `streaming` waits for events, and its cancellation
        (`stalled`) when a send blocks past the stall limit."""
        self._streaming = streaming
        self._timer = self._loop.call_at(self._last_sent + self._keepalive_s, self._on_timer)

    async def body(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def send(self, message: Message) -> None:
        self._num_sending += 1
        if self._num_sending == 1:
            self._blocked_since = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._num_sending -= 1
            self._last_sent = self._blocked_since = self._loop.time()  # the reader took this one

    def _on_timer(self) -> None:
        now = self._loop.time()
        if self._num_sending:
            if self._stall_timeout_s is None:
                due = now + self._keepalive_s  # no limit: look again later
            elif now - self._blocked_since >= self._stall_timeout_s:
                self.stalled = True
                self._streaming.cancel()
                return
            else:
                due = self._blocked_since + self._stall_timeout_s
        elif now - self._last_sent >= self._keepalive_s and not self.finishing:
            self._keepalive = asyncio.ensure_future(self._keep_alive())
            due = now + self._keepalive_s
        else:
            due = self._last_sent + self._keepalive_s
        self._timer = self._loop.call_at(due, self._on_timer)

    async def _keep_alive(self) -> None:
        # The stream may have sent events, its last included, between the timer and this task's start.
        if not self.finishing and self._loop.time() - self._last_sent >= self._keepalive_s:
            await self.body(KEEPALIVE)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)


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
