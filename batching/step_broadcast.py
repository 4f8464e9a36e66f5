"""Multi-process serving: process 0 schedules and broadcasts each step's padded inputs; the others replay them.

In a multi-process JAX job every process must launch the same computations in the same order. Only process 0
runs the HTTP server and the scheduler. Before each step it broadcasts a small fixed-size header (the step's
shape and whether structured-output masks follow, or "stop") and then the padded inputs, over the same
cross-process collectives the model uses (gloo on CPU, NCCL on GPU); the other processes receive them and launch
the identical jitted step. Masks, filled while the model runs, follow as a second payload before the sampler.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all

HEADER_LEN = 9
_STOP, _STEP = 0, 1


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def send_step(shape: tuple[int, ...], payload: Any) -> None:
    """Process 0: announces a step by `shape` (HEADER_LEN - 1 ints: the bucket, 1 if masks follow, how many slot
    rows it writes, 1 if it scores prompt tokens) and sends its inputs (a numpy pytree)."""
    broadcast_one_to_all(np.array([_STEP, *shape], np.int32))
    broadcast_one_to_all(payload)


def send_payload(payload: Any) -> None:
    """Process 0: more inputs of the step it announced last (a numpy pytree the others `receive_payload`)."""
    broadcast_one_to_all(payload)


def send_stop() -> None:
    """Process 0: tells the other processes there are no more steps."""
    broadcast_one_to_all(np.zeros(HEADER_LEN, np.int32))


def receive_step_shape() -> tuple[int, ...] | None:
    """Other processes: the next step's `shape` as `send_step` sent it, or None when process 0 stops."""
    header = broadcast_one_to_all(np.zeros(HEADER_LEN, np.int32))
    return None if header[0] == _STOP else tuple(int(x) for x in header[1:])


def receive_payload(template: Any) -> Any:
    """Other processes: the step's inputs, shaped like `template` (a zero-filled pytree of the same shapes)."""
    return broadcast_one_to_all(template)
