"""Device meshes for tensor parallelism (and the multi-host start-up that precedes them)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

TP_AXIS = "tensor"
"""The mesh axis over which attention heads, MLP columns and the vocabulary are split."""


class InvalidTensorParallelism(ValueError):
    """--tp cannot be served on these devices or with this model; the message names the valid values."""


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process settings (`sluice serve --coordinator-address --num-processes --process-id`)."""

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0


def initialize_distributed(config: DistributedConfig) -> None:
    """Joins a multi-process JAX job so one mesh spans every process's devices (no-op for one process).

    Every process runs the same command with its own process id; process 0's address is the coordinator.
    """
    if config.num_processes <= 1:
        return
    if not config.coordinator_address:
        raise ValueError("multi-process serving needs --coordinator-address (host:port of process 0)")
    if not 0 <= config.process_id < config.num_processes:
        raise ValueError(
            f"--process-id must be in [0, {config.num_processes}), got {config.process_id}"
        )
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
    )


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh of `tp` devices named `TP_AXIS` (all processes' devices when running multi-host)."""
    devices = jax.devices() if devices is None else devices
    if tp < 1:
        raise InvalidTensorParallelism(f"--tp must be at least 1, got {tp}")
    if tp > len(devices):
        raise InvalidTensorParallelism(
            f"--tp {tp} needs {tp} devices but only {len(devices)} {devices[0].platform} device(s) are visible"
        )
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))
