"""Noticing that an HTTP client has gone, so its engine work can be aborted at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

from app.errors import APIError

T = TypeVar("T")


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
