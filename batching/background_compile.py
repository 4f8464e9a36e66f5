"""Programs compiled on a thread of their own, so that a step never waits for one.

The runner compiles what a step may need at warm-up. A program met later (the host decides the sampler's plan, and
a request brings filters or logprobs no warmed plan covers) would otherwise compile on the engine thread, and every
running request would stall for it: seconds for a multi-step call on a GPU. Instead the step runs a warmed
program that gives the same tokens, and the exact one compiles here; steps take it once it is ready.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Hashable

import jax

logger = logging.getLogger(__name__)

_Job = tuple[Hashable, Callable[[], jax.stages.Lowered]]


class BackgroundCompiler:
    """Compiles lowered programs one at a time on a daemon thread, each key once; owned by the engine thread.

    The thread holds the queue and the finished programs, not the compiler: once its owner drops the compiler, the
    thread ends after the job it is on (a process that builds engine after engine keeps no thread per engine).
    """

    def __init__(self) -> None:
        self._ready: dict[Hashable, jax.stages.Compiled] = {}  # written by the compile thread, read by the owner
        self._queued: set[Hashable] = set()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()  # None: stop
        self._thread: threading.Thread | None = None

    def get(self, key: Hashable) -> jax.stages.Compiled | None:
        """The compiled program for `key`; None until it is ready."""
        return self._ready.get(key)

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` was submitted."""
        return key in self._queued

    def submit(self, key: Hashable, lower: Callable[[], jax.stages.Lowered]) -> None:
        """Queues `lower().compile()` for `key`. `lower` runs on the compile thread: it must not read arrays a step
        may donate meanwhile (lower against their `shapes_of`)."""
        self._queued.add(key)
        self._jobs.put((key, lower))
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._jobs, self._ready), name="sluice-compile",
                                            daemon=True)
            _threads[self._thread] = self._jobs
            self._thread.start()
            weakref.finalize(self, _stop, self._jobs).atexit = False  # at exit, `_close_all` stops it

    @property
    def num_compiled(self) -> int:
        return len(self._ready)

    def wait(self) -> None:
        """Blocks until every program submitted so far is compiled (or failed)."""
        self._jobs.join()


def _stop(jobs: queue.Queue[_Job | None]) -> None:
    """Drops the jobs not started and stops the thread after the one compiling: a dropped engine's programs are
    not compiled for nobody (a multi-step call's take seconds on a GPU, and hold their memory meanwhile)."""
    while True:
        try:
            jobs.get_nowait()
        except queue.Empty:
            break
        jobs.task_done()
    jobs.put(None)


def _work(jobs: queue.Queue[_Job | None], ready: dict[Hashable, jax.stages.Compiled]) -> None:
    while True:
        job = jobs.get()
        try:
            if job is None:
                _threads.pop(threading.current_thread(), None)
                return
            key, lower = job
            ready[key] = lower().compile()
        except Exception:  # noqa: BLE001 - a failed program stays queued: its steps keep the stand-in
            logger.exception("compiling %s off the engine thread failed", job[0])
        finally:
            jobs.task_done()


def shapes_of(tree):
    """Each array of `tree` (jax or numpy) as its shape, dtype and (a committed jax array's) sharding, to lower
    against: lowered so, a program is the one jit compiles when called with the arrays (and finds in its cache)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if getattr(x, "committed", False) else None), tree)


# Compile threads still running, with their jobs: a dropped compiler's too (stopped, it ends after the program it
# is on).
_threads: dict[threading.Thread, queue.Queue[_Job | None]] = {}


@atexit.register
def _close_all() -> None:
    """Stops every compile thread and waits for the program it compiles: a process that exits in the middle of a
    compile is aborted by XLA."""
    for thread, jobs in list(_threads.items()):
        _stop(jobs)
        thread.join()
