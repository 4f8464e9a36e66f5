"""Graceful shutdown for uvicorn: on SIGTERM (or Ctrl+C) stop admitting, finish what is in flight, exit 0."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from app.state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the socket at once.

    While draining, the listening socket stays open so that new requests get a clear 503 (and /health
    turns 503 for load balancers), in-flight requests run to completion for up to `drain_timeout_s`,
    and then uvicorn's own shutdown runs (the app's lifespan stops the engine). A second signal exits
    at once. The signal is not re-raised afterwards, so a drained process exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._state.draining
            return
        self._state.begin_drain()
        # A signal handler runs between two bytecodes of the loop's thread; hand over to the loop.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("Draining: new requests get 503; waiting up to %.0f s for requests in flight", self._drain_timeout_s)
        if not await self._state.wait_idle(self._drain_timeout_s):
            logger.warning("Drain timeout: aborting the requests still in flight")
        self.should_exit = True
