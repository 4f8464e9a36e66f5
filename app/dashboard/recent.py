"""What the HTTP side saw of requests since the dashboard last looked: raw latencies and errors.

Appends only, on the event loop; the dashboard's tick takes them. Bounded, so that a server nobody
watches (`--no-ui`) keeps the newest and drops the oldest.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from sluice.app.anthropic_errors import OVERLOADED

ErrorKind = Literal["400", "429", "5xx", "aborted"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("400", "429", "5xx", "aborted")

CAPACITY = 100_000


def error_kind(status: int) -> ErrorKind | None:
    """The dashboard's class of an HTTP status: client errors (400, 401, 404, 413: "400"), a full queue
    ("429"; Anthropic's routes say it as their 529), server errors ("5xx"), a client gone before its answer (499:
    "aborted"); None below 400."""
    if status < 400:
        return None
    if status in (429, OVERLOADED):
        return "429"
    if status == 499:
        return "aborted"
    return "5xx" if status >= 500 else "400"


@dataclass(frozen=True)
class ErrorEntry:
    """`source`: the route, or the request id of a stream that failed after its 200."""

    unix_s: float
    kind: ErrorKind
    status: int
    source: str
    message: str


@dataclass(frozen=True)
class Taken:
    """Latencies in seconds: TTFT and ITL of every request, end to end of the successful ones."""

    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    errors: list[ErrorEntry]


class RecentRequests:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.ttft: deque[float] = deque(maxlen=capacity)
        self.itl: deque[float] = deque(maxlen=capacity)
        self.e2e: deque[float] = deque(maxlen=capacity)
        self.errors: deque[ErrorEntry] = deque(maxlen=capacity)

    def error(self, status: int, source: str, message: str) -> None:
        kind = error_kind(status)
        if kind is not None:
            self.errors.append(ErrorEntry(time.time(), kind, status, source, message))

    def take(self) -> Taken:
        taken = Taken(list(self.ttft), list(self.itl), list(self.e2e), list(self.errors))
        for values in (self.ttft, self.itl, self.e2e, self.errors):
            values.clear()
        return taken
