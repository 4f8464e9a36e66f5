"""One Sluice replica under Ray Serve: an engine and the single process's Starlette app, driven in-process.

The ingress (`app/ingress.py`) reads each request's body, because the prefix-aware router
(`app/prefix_router.py`) needs its prompt, and hands the replica the request as plain data
(`ForwardedRequest`). The replica runs it through the very ASGI app `sluice serve` runs, so routes,
validation, SSE framing, keep-alives and errors are the single process's, and streams back what the app
sends: a `ResponseStart`, the body's bytes as they come (whatever the app sent since the last item, in one
piece, so a busy stream costs one Ray object per batch of events rather than per event), and last a
`ReplicaReport` with the replica's prefix-cache counters, which the ingress exports per replica.

A client that goes away is a cancelled stream here: the app then receives `http.disconnect`, which aborts the
engine request as it would in the single process. Ray Serve calls `__del__` once the replica's requests in
flight have finished, so a replica that is scaled down lets its streams complete; `__del__` then drains what no
request holds (background responses) for up to `drain_timeout_s`, aborting what is left, before its engine stops.
Ray Serve kills the replica `graceful_shutdown_timeout_s` (`--drain-timeout`) after the shutdown began, whichever
step it is at.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from ray import serve

from sluice.app.engine_loading import load_engine
from sluice.app.prefix_router import Routing
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import EngineConfig
from sluice.model.roofline import Peaks

logger = logging.getLogger("sluice.replicas")

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica builds: its engine, the HTTP settings of its app, and the dashboard's peaks if declared."""

    engine: EngineConfig
    settings: ServerSettings
    declared_peaks: Peaks | None = None
    drain_timeout_s: float = 30.0  # `--drain-timeout`


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it, body read whole."""

    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    """The app's status and headers, and which replica answers."""

    status: int
    headers: Headers
    replica: str


@dataclass(frozen=True)
class ReplicaReport:
    """A replica's cumulative prefix-cache counters (tokens), sent after each response it completes."""

    replica: str
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int


ReplicaItem = ResponseStart | bytes | ReplicaReport


class SluiceReplica:
    """A Ray Serve deployment class: `forward` streams one request through this replica's Sluice app."""

    async def __init__(self, config: ReplicaConfig) -> None:
        self._name = serve.get_replica_context().replica_id.unique_id
        self._state = ServerState(config.settings, replica=self._name)
        self._drain_timeout_s = config.drain_timeout_s
        self._app = create_app(self._state, cors=False)  # the ingress applies the CORS policy
        # The app's lifespan (the dashboard's feed; on exit, the engine's shutdown), as uvicorn would run it; None
        # until entered (Ray Serve calls `__del__` after a constructor that raised too).
        self._lifespan: AbstractAsyncContextManager | None = None
        engine, peaks = await asyncio.to_thread(
            load_engine, config.engine, config.settings.ui, config.declared_peaks, False)
        await engine.start()
        self._state.set_engine(engine, peaks)
        lifespan = self._app.router.lifespan_context(self._app)
        await lifespan.__aenter__()
        self._lifespan = lifespan
        logger.info("Sluice replica %s is ready", self._name)

    async def forward(self, routing: Routing, request: ForwardedRequest) -> AsyncIterator[ReplicaItem]:
        """`request` through the app; `routing` is for the router, which reads a call's first argument."""
        sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.put_nowait(message)

        app = asyncio.ensure_future(self._app(_scope(request), receive, send))
        app.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            finished = False
            while not finished:
                messages = [await sent.get()]
                while not sent.empty():
                    messages.append(sent.get_nowait())
                body = bytearray()
                for message in messages:
                    if message is None:
                        finished = True
                    elif message["type"] == "http.response.start":
                        yield ResponseStart(message["status"], tuple(message.get("headers", ())), self._name)
                    elif message["type"] == "http.response.body":
                        body += message.get("body", b"")
                if body:
                    yield bytes(body)
            if not app.cancelled() and app.exception() is not None:
                # Starlette re-raises an unexpected error after it has sent the 500; log it as uvicorn would.
                logger.error("error in the Sluice app on %s", request.path, exc_info=app.exception())
            yield self._report()
        finally:
            disconnected.set()
            if not app.done():
                await asyncio.wait({app}, timeout=5.0)
                app.cancel()

    def _report(self) -> ReplicaReport:
        stats = self._state.engine.stats if self._state.engine is not None else None
        if stats is None:
            return ReplicaReport(self._name, 0, 0)
        return ReplicaReport(self._name, stats.prefix_cache_hit_tokens, stats.prefix_cache_query_tokens)

    async def __del__(self) -> None:
        await self._state.drain(self._drain_timeout_s)
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "scheme": "http",
        "method": request.method,
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": [list(header) for header in request.headers],
        "client": None,
        "server": None,
        "state": {},
    }
