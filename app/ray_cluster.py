"""What `sluice serve --replicas` and `--hosts` share: joining Ray, and stopping on a signal."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import ray


def connect(address: str | None, cpus_needed: int) -> None:
    """Joins the Ray cluster at `address`, or starts a local one (without the dashboard) with at least
    `cpus_needed` logical CPUs: each Sluice actor asks for one, and on a CPU-only machine they all share its cores."""
    if address is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus_needed), include_dashboard=False)
    else:
        ray.init(address=address)


@contextmanager
def stop_on_signal() -> Iterator[threading.Event]:
    """An event the first SIGINT/SIGTERM sets (the caller then stops gracefully); a second one exits at once."""
    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if stop.is_set():
            os._exit(1)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
