"""Server-Sent Events framing and a streaming response that notices a client leaving.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.disconnect import wait_for_disconnect

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict | str) -> bytes:
    """One event; a dict is sent as compact JSON, a str as it is (already-serialized JSON)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that stops its events as soon as the client disconnects.

    Stopping is what aborts the engine request and frees its KV pages, so it must happen when the client
    leaves, not at the next token (which may be far off for a queued request). Starlette only watches
    for the disconnect under ASGI spec < 2.4; this does it whatever the server. `on_close` runs last in
    every case, including a client gone before the first event.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            # A task parked in `send` rather than inside the generator was cancelled without reaching
            # the generator's own cleanup; close it explicitly.
            await self._events.aclose()
            await self._on_close()
        if not streaming.cancelled() and streaming.exception() is not None:
            error = streaming.exception()
            if not isinstance(error, OSError):  # the client went away mid-send
                raise error
