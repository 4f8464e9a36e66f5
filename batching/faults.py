"""Test-only fault injection: `SLUICE_FAULT=KIND@N` makes the runner's N-th dispatched step (from 1) misbehave.

KIND "raise": fetching the step's results raises, as a device error surfaces; "nan": the step's first sampled
row gets NaN logits, one sequence's numerics gone bad (single steps only: the first from the N-th on); "hang":
fetching never returns, as a hung kernel (for `--step-timeout`). Read once, when the runner is built.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Literal

KINDS = ("raise", "nan", "hang")


@dataclass
class Fault:
    kind: Literal["raise", "nan", "hang"]
    step: int
    fired: bool = False

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get("SLUICE_FAULT")
        if not spec:
            return None
        kind, _, step = spec.partition("@")
        if kind not in KINDS or not step.isdigit() or int(step) < 1:
            raise ValueError(f"SLUICE_FAULT must be KIND@N with KIND one of {', '.join(KINDS)} and N >= 1, "
                             f"got {spec!r}")
        return cls(kind, int(step))  # type: ignore[arg-type]

    def fires(self, num_dispatched: int, single_step: bool) -> str | None:
        """The fault's kind if it strikes the `num_dispatched`-th step (once), else None."""
        if self.fired or num_dispatched < self.step or (self.kind == "nan" and not single_step):
            return None
        self.fired = True
        return self.kind


def strike(kind: str | None, step: object) -> None:
    """At a struck step's fetch: raise, or block for good."""
    if kind == "raise":
        raise RuntimeError(f"injected fault (SLUICE_FAULT): the device step {step} failed")
    if kind == "hang":
        threading.Event().wait()
