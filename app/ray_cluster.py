"""What `sluice serve --replicas` and `--hosts` share: joining Ray and leaving it, and stopping on a signal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

import ray
from ray._private import ray_constants

if TYPE_CHECKING:
    import psutil
    from ray._private.node import Node

# The variables that configure an engine in the process running it: Sluice's own (the model and kernel folder, the
# compilation cache, ...), jax's (JAX_PLATFORMS, its cache settings, ...) and XLA's (XLA_FLAGS, and the share of each
# GPU that `--gpu-memory-utilization` claims in XLA_CLIENT_MEM_FRACTION before jax starts; TF_CPP_* its logging), and
# huggingface_hub's for a Hub model (HF_* and HUGGING_FACE_*, as vLLM forwards them: its token, cache, offline switch;
# TRANSFORMERS_OFFLINE, the offline switch's other name).
ENGINE_VARIABLE_PREFIXES = ("SLUICE_", "JAX_", "XLA_", "TF_CPP_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE")
# How long the raylet's workers and agents get to end once it is stopped (as long as Ray gives them); they take a
# fifth of a second.
RAYLET_ORPHANS_S = 1.0
# How long the cluster's processes get to be gone once killed: milliseconds; one stuck in the kernel (a hung disk's
# read) is left behind rather than waited for.
KILLED_S = 5.0


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` an engine reads (`ENGINE_VARIABLE_PREFIXES`)."""
    return {name: value for name, value in environ.items() if name.startswith(ENGINE_VARIABLE_PREFIXES)}


def connect(address: str | None, cpus_needed: int) -> Node | None:
    """Joins the Ray cluster at `address`, or starts a local one (without the dashboard) with at least
    `cpus_needed` logical CPUs: each Sluice actor asks for one, and on a CPU-only machine they all share its cores.
    The local cluster's node, for `disconnect` to stop; None for a joined cluster, which goes on.

    A local cluster is this process's own whatever RAY_ADDRESS or `ray start` name (Ray would join theirs), and its
    workers inherit this process's environment. A joined cluster's workers have their node's environment: the
    engine's variables travel with the job (Ray's `runtime_env`), which its actors and Serve's replicas take.
    """
    if address is None:
        # The cluster's processes (in this process group) inherit SIGTERM blocked, as Ray blocks SIGINT in them: a
        # SIGTERM to the whole group, or to each process (a supervisor's, `timeout`'s, systemd's), reaches this
        # process alone, which drains the application before `disconnect` stops them (with SIGKILL). Their workers
        # inherit it too: the application's processes take their stop from this one as well.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cpus_needed), include_dashboard=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return ray._private.worker._global_node
    ray.init(address=address, runtime_env={"env_vars": engine_environment(os.environ)})
    return None


def disconnect(started: Node | None) -> None:
    """Leaves Ray, and stops the local cluster `connect` started (`started`, its node); a joined one goes on.

    Ray would stop a local cluster's processes one after another, each with SIGTERM and a second's wait before
    SIGKILL; theirs is blocked (`connect`), so each second would be waited in vain (4 s of every stop). They get the
    SIGKILL at once, in Ray's order: the raylet, then, once the workers and agents it started have seen it gone
    (telling the GCS so: without it, they would linger a minute), the GCS and the others.
    """
    if started is None:
        ray.shutdown()
        return
    ray._private.worker._global_node = None  # `ray.shutdown` leaves the cluster, and stops none of its processes
    ray.shutdown()
    started.destroy_external_storage()  # what Ray spilled to disk, as `ray.shutdown` removes a head's
    import psutil  # Ray's own copy, where no other is installed: importable once Ray is

    killed = [info.process for infos in started.all_processes.values() for info in infos]
    raylet = started.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    try:
        orphans = [child for info in raylet for child in psutil.Process(info.process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # the raylet died before the stop, and its processes with it
        orphans = []
    started.kill_raylet(check_alive=False)
    deadline = time.monotonic() + RAYLET_ORPHANS_S
    while any(_running(process) for process in orphans) and time.monotonic() < deadline:
        time.sleep(0.02)
    # Waited for here, not by Ray: Ray 2.50 waits for each without a bound.
    started.kill_all_processes(check_alive=False, allow_graceful=False, wait=False)
    deadline = time.monotonic() + KILLED_S
    for process in killed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))


def _running(process: psutil.Process) -> bool:
    """Whether `process` runs: one that has exited may stay a zombie a while, its parent gone."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
