"""The push side: a task ticks the timeline once a second and every open dashboard gets the new sample.

A sample is encoded once, whatever the number of dashboards; each stream waits for the next tick and sends
the latest (a stream too slow for one tick skips it rather than queueing). The engine is only read, never
called: the tick takes its stats snapshot.

Events: first `{"config", "history": [sample, ...], "live"}`, then `{"sample", "live"}` each tick (`sample`:
`Timeline.Sample.as_json`; `live`: `Timeline.live`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator

from sluice.app.dashboard.timeline import HISTORY_S, WINDOW_S, Timeline
from sluice.app.state import ServerState
from sluice.app.streaming import sse_event

TICK_S = 1.0


class Feed:
    def __init__(self, state: ServerState, tick_s: float = TICK_S) -> None:
        self._state = state
        self._tick_s = tick_s
        self.timeline: Timeline | None = None  # once the engine is ready
        self._message = b""
        self._ticked = asyncio.Event()

    async def run(self) -> None:
        """Ticks until cancelled (the app's shutdown), on a fixed schedule that does not drift."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self._tick_s
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            self.tick()

    def tick(self) -> None:
        engine = self._state.engine
        if engine is None:
            return
        if self.timeline is None:
            self.timeline = Timeline(self._state.peaks)
        sample = self.timeline.tick(time.monotonic(), time.time(), engine.stats, self._state.metrics.recent.take())
        self._message = sse_event(_object(sample=sample.json_text, live=json.dumps(self.timeline.live())))
        ticked, self._ticked = self._ticked, asyncio.Event()
        ticked.set()

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The first event: the settings and the history; then one per tick. Ends when the server drains
        (an open dashboard must not hold up the shutdown)."""
        while self.timeline is None and not self._state.draining:
            await self._ticked.wait()
        if self.timeline is None:
            return
        history = "[" + ",".join(s.json_text for s in self.timeline.samples) + "]"
        yield sse_event(_object(config=json.dumps(self._config()), history=history,
                                live=json.dumps(self.timeline.live())))
        while not self._state.draining:
            await self._ticked.wait()
            yield self._message

    def _config(self) -> dict:
        state, engine = self._state, self._state.engine
        peaks = state.peaks
        return {
            "model": state.model_name,
            "max_num_seqs": engine.config.max_num_seqs,
            "speculative": engine.config.speculative is not None,
            "prefix_store": engine.prefix_store is not None,
            "slo_ttft_ms": state.settings.slo_ttft_ms,
            "slo_itl_ms": state.settings.slo_itl_ms,
            "peaks": None if peaks is None else {"matmul_gflops": peaks.matmul_gflops,
                                                 "bandwidth_gbs": peaks.bandwidth_gbs, "device": peaks.device},
            "history_s": HISTORY_S,
            "window_s": WINDOW_S,
            "tick_s": self._tick_s,
        }


def _object(**encoded: str) -> str:
    """A JSON object of already-encoded values (the samples' cached text is not encoded again)."""
    return "{" + ",".join(f'"{name}":{value}' for name, value in encoded.items()) + "}"
