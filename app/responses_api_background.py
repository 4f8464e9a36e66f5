"""Background responses of `/v1/responses` (`background: true`): their generations, run by tasks of the server's
apart from any connection, and the events of those created with `stream: true`.

`BackgroundRuns` (held by the server state) owns the tasks: one per response still running, started by `start` and
forgotten as it ends, when its final state (completed, incomplete, failed, or cancelled by `BackgroundRun.cancel`)
goes to the store. A run's events are kept while it runs (each streamed event once: no more than the reply has
tokens, plus a few), so that `GET /v1/responses/{id}?stream=true&starting_after=N` replays those after N and then
follows the new ones; once it has ended they are stored with its final state, within the store's bounds.

A run's task alone reads its generation and closes it, after storing its final state: it holds the generation's
admission until then, so a SIGTERM drain waits for it to be stored; one the drain's timeout aborts fails (status
`failed`, the abort its `error`), as an engine error does. A cancel only aborts the engine request and waits for the
task (the builder tells the cancel's abort from the server's: `Generation.cancel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Protocol

from sluice.app.responses_api_schemas import ResponseObject

# Stores a background response's final state, with its events if it was streamed.
Store = Callable[[ResponseObject, tuple[bytes, ...]], None]


class RunGeneration(Protocol):
    """What a run does with its generation (`Generation`'s)."""

    def cancel(self) -> None: ...

    async def close(self) -> None: ...


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
    its events if it is streamed, `generation` the engine work behind it."""

    def __init__(self, response: ResponseObject, log: EventLog | None, generation: RunGeneration) -> None:
        self.response = response
        self.log = log
        self.generation = generation
        self.task: asyncio.Future[None] | None = None

    async def cancel(self) -> None:
        """Aborts its engine request (freeing its KV pages) and waits until its task has stored it, cancelled
        (or as it ended, if it ended first)."""
        self.generation.cancel()
        await asyncio.wait({self.task})


class BackgroundRuns:
    """The background responses still running, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def start(self, run: BackgroundRun, events: AsyncGenerator[bytes, None], store: Store,
              ended: Callable[[], None]) -> None:
        """Runs `run` through `events` in a task of its own; its final state then goes to `store`, and `ended` is
        called as it ends, whichever way (its conversation freed)."""
        self._runs[run.response.id] = run
        run.task = asyncio.ensure_future(self._run(run, events, store, ended))

    async def _run(self, run: BackgroundRun, events: AsyncGenerator[bytes, None], store: Store,
                   ended: Callable[[], None]) -> None:
        try:
            async with aclosing(events):
                async for event in events:
                    if run.log is not None:
                        run.log.append(event)
            store(run.response, tuple(run.log.events) if run.log is not None else ())
        finally:  # also when the loop ends under it (a server stopped past its drain)
            await run.generation.close()  # after the store: its admission released, a drain may end
            del self._runs[run.response.id]
            ended()
            if run.log is not None:
                run.log.end()
