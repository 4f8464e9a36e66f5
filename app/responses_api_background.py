"""Background responses of `/v1/responses` (`background: true`): their generations, run by tasks of the server's
apart from any connection, and the events of those created with `stream: true`.

`BackgroundRuns` (held by the server state) owns the tasks: one per response still running, started by `start` and
forgotten as it ends, when its final state (completed, incomplete, failed, or cancelled by `BackgroundRun.cancel`)
goes to the store. A run's events are kept while it runs (each streamed event once: no more than the reply has
tokens, plus a few), so that `GET /v1/responses/{id}?stream=true&starting_after=N` replays those after N and then
follows the new ones; once it has ended they are stored with its final state, within the store's bounds.

A run holds its generation's admission until it ends, so a SIGTERM drain waits for it; one the drain's timeout
aborts fails (status `failed`, the abort its `error`), as an engine error does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from sluice.app.responses_api_schemas import ResponseObject

# Stores a background response's final state, with its events if it was streamed.
Store = Callable[[ResponseObject, tuple[bytes, ...]], None]


class EventLog:
    """A streamed background response's SSE events, in order (an event's index is its `sequence_number`), until it
    has `ended`."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.ended = False
        self._grown = asyncio.Event()  # set (and replaced) at each change, waking every follower

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self._changed()

    def end(self) -> None:
        self.ended = True
        self._changed()

    async def after(self, starting_after: int | None) -> AsyncGenerator[bytes, None]:
        """The events after the sequence number `starting_after` (all without it), then each new one until the
        end."""
        index = 0 if starting_after is None else starting_after + 1
        while True:
            grown = self._grown
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.ended:
                return
            await grown.wait()

    def _changed(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()


async def replayed(events: Sequence[bytes], starting_after: int | None) -> AsyncGenerator[bytes, None]:
    """A stored (ended) response's events after the sequence number `starting_after`, as `EventLog.after` gives a
    running one's."""
    for event in events[0 if starting_after is None else starting_after + 1:]:
        yield event


class BackgroundRun:
    """One background response running: `response` is its state as it goes (the builder's, filled in place), `log`
    its events if it is streamed; `close` closes its generation (`Generation.close`: aborts its engine request if
    unfinished, and releases its admission)."""

    def __init__(self, response: ResponseObject, log: EventLog | None, close: Callable[[], Awaitable[None]]) -> None:
        self.response = response
        self.log = log
        self.cancelling = False
        self.task: asyncio.Future[None] | None = None
        self._close = close

    async def cancel(self) -> None:
        """Aborts its engine request (freeing its KV pages) and waits until it has been stored as cancelled."""
        self.cancelling = True
        await self._close()
        await asyncio.wait({self.task})

    async def generate(self, events: AsyncGenerator[bytes, None]) -> None:
        """Runs its generation through `events` (its builder's, which end the response, or fail it, in place),
        keeping them when streamed. A failure that the cancel's abort caused is the cancel: the response is
        cancelled, and its events end without that failure's."""
        try:
            async for event in events:
                if self.cancelling and self.response.status == "failed":
                    self.response.status = "cancelled"
                    self.response.error = None
                elif self.log is not None:
                    self.log.append(event)
        finally:
            await self._close()


class BackgroundRuns:
    """The background responses still running, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def start(self, run: BackgroundRun, events: AsyncGenerator[bytes, None], store: Store) -> None:
        """Runs `run` through `events` in a task of its own; its final state then goes to `store`."""
        self._runs[run.response.id] = run
        run.task = asyncio.ensure_future(self._run(run, events, store))

    async def _run(self, run: BackgroundRun, events: AsyncGenerator[bytes, None], store: Store) -> None:
        try:
            await run.generate(events)
            store(run.response, tuple(run.log.events) if run.log is not None else ())
        finally:  # also when the loop ends under it (a server stopped past its drain)
            del self._runs[run.response.id]
            if run.log is not None:
                run.log.end()
