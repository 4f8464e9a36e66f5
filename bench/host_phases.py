"""Wall-clock timers around the engine's host phases, per decode step (`bench.host_overhead`, `bench.engine_check`).

Phases: schedule, inputs (building the step's arrays), dispatch, collect (turning the fetched arrays into a
sequence's tokens, for those not appended in one pass), append (tokens onto sequences, stop ids, max_tokens)
and emit (detokenize, stop strings, delivery); `wait` is the time the host blocks on the device's results. `cpu` is the engine
thread's CPU time per step (`time.thread_time` around `Engine.step`): its host work without the time it waits, for
the device or for a core, so it holds on a loaded machine where wall-clock phases do not.
"""

from __future__ import annotations

import time
from collections import defaultdict

from sluice.batching import step_output
from sluice.batching.engine import Engine

PHASES = ("schedule", "inputs", "dispatch", "collect", "append", "emit")


class PhaseTimer:
    """Wall-clock timers around the engine's phase functions (its code is unchanged); `wait` is the time the
    host blocks on the device's results."""

    def __init__(self, engine: Engine):
        self.totals: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str, object]] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "_pad", "inputs")
        self._wrap(engine.runner, "_run", "dispatch")
        self._wrap(step_output.StepOutput, "runs", "collect")
        self._wrap(step_output.StepOutput, "share", "collect")
        self._wrap(step_output.PendingStep, "fetch", "wait")
        self._wrap(engine, "_append_decoded", "append")
        self._wrap(engine, "_append_output", "append")
        self._wrap(engine, "_emit_text", "emit")
        self._wrap(engine, "_flush", "emit")
        self._wrap(engine, "step", "cpu", time.thread_time)

    def _wrap(self, owner, name: str, phase: str, clock=time.perf_counter) -> None:
        inner = getattr(owner, name)
        totals = self.totals

        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[phase] += clock() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, inner))

    def close(self) -> None:
        for owner, name, inner in reversed(self._restore):
            setattr(owner, name, inner)
        self._restore.clear()

    def per_step_ms(self, steps: float) -> dict[str, float]:
        """Milliseconds per decode step of each phase and of `wait` (blocked on the device)."""
        ms = {phase: 1e3 * seconds / steps for phase, seconds in self.totals.items()}
        return {**{phase: ms.get(phase, 0.0) for phase in PHASES}, "wait": ms.get("wait", 0.0),
                "cpu": ms.get("cpu", 0.0)}
