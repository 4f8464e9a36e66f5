"""`sluice serve --hosts H`: one Sluice engine whose tensor parallelism spans H processes, one per host, as Ray actors.

The multi-process serving of `--coordinator-address/--num-processes/--process-id` (`sharding/mesh.py`: process 0
serves HTTP and schedules, the others run its steps), started by Ray instead of by hand: a placement group of H
bundles (spread over the cluster's nodes where it has that many; each bundle the host's share of `--tp` GPUs, or a
CPU), one `SluiceProcess` actor per bundle, `jax.distributed` initialized with process 0's actor as coordinator
(an address it picks on its own node). The first SIGTERM/SIGINT is passed on to process 0, which drains as the
single process does (or ends at once, still loading); its shutdown ends the others' step loops. One before the
cluster has the bundles stops the wait. A second exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sluice.app.addresses import host_port
from sluice.app.ray_cluster import connect, disconnect, stop_on_signal

# `sluice serve`'s entry point for one process, given by its caller (app/serve.py imports this module).
ServeProcess = Callable[[argparse.Namespace], int]
# How long the processes get to end once process 0 has ended or been told to stop: its shutdown ends the others'
# step loops at once.
FOLLOWERS_S = 60.0


@ray.remote
class SluiceProcess:
    """One process of the job: `serve` runs `sluice serve`'s entry point with this process's place in it (on the
    actor's main thread, so that the leader's uvicorn takes SIGTERM as it does outside Ray)."""

    def coordinator_address(self) -> str:
        """host:port on this actor's node where `jax.distributed`'s coordinator can listen."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return host_port(ray.util.get_node_ip_address(), port)

    def pid(self) -> int:
        return os.getpid()

    def serve(self, run: ServeProcess, args: argparse.Namespace) -> int:
        # A local cluster's workers inherit SIGTERM blocked from its raylet (`connect`): process 0's uvicorn would
        # never take the one `_terminate` sends. Unblocked on this thread alone, which the kernel then delivers it to.
        blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        try:
            return run(args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@ray.remote(num_cpus=0)
def _terminate(pid: int) -> None:
    """SIGTERM to `pid`, from a task placed on that process's node (which may have ended on its own meanwhile)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def serve_on_hosts(run: ServeProcess, args: argparse.Namespace, hosts: int, gpus_per_host: int) -> int:
    """Runs `args` (a parsed `sluice serve` command line) with `run` as `hosts` processes; the worst exit status.

    `gpus_per_host`: each process's GPUs on a cluster with GPUs (0: a CPU each).
    """
    connect(args.ray_address, hosts)
    try:
        with stop_on_signal() as stop:
            if ray.cluster_resources().get("GPU", 0) == 0:
                gpus_per_host = 0
            bundle = {"CPU": 1, "GPU": gpus_per_host} if gpus_per_host else {"CPU": 1}
            group = placement_group([bundle] * hosts, strategy="SPREAD")
            try:
                # Waited for in steps, as the processes are below: a joined cluster may lack the resources for long.
                ready = group.ready()
                while not stop.is_set() and not ray.wait([ready], timeout=0.5)[0]:
                    pass
                if stop.is_set():
                    print("Stopped before the cluster had the processes' resources", flush=True)
                    return 0
                return _run(run, args, hosts, group, gpus_per_host, stop)
            finally:
                remove_placement_group(group)
    finally:
        disconnect()


def _run(run: ServeProcess, args: argparse.Namespace, hosts: int, group: PlacementGroup, gpus_per_host: int,
         stop: threading.Event) -> int:
    def placed(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

    processes = [SluiceProcess.options(scheduling_strategy=placed(i), num_cpus=1, num_gpus=gpus_per_host).remote()
                 for i in range(hosts)]
    coordinator = ray.get(processes[0].coordinator_address.remote())
    leader_pid = ray.get(processes[0].pid.remote())
    runs = [process.serve.remote(run, _place(args, coordinator, hosts, i)) for i, process in enumerate(processes)]
    while not stop.is_set() and not ray.wait([runs[0]], timeout=0.5)[0]:
        pass
    if stop.is_set():
        print("Stopping: process 0 finishes its requests in flight", flush=True)
        ray.get(_terminate.options(scheduling_strategy=placed(0)).remote(leader_pid))
    # Process 0's shutdown ends the others' step loops; one that is still running a while later is stuck.
    _, stuck = ray.wait(runs, num_returns=len(runs), timeout=FOLLOWERS_S)
    for i, (process, run) in enumerate(zip(processes, runs)):
        if run in stuck:
            print(f"sluice serve: error: process {i} was still running {FOLLOWERS_S:.0f} s after "
                  f"{'the stop' if stop.is_set() else 'process 0 ended'}: killed", file=sys.stderr, flush=True)
            ray.kill(process)
    if stop.is_set() and runs[0] not in stuck and _died(runs[0]):
        # A signal before the model is ready ends process 0 at once (as it ends a single process), and without it
        # the others' `jax.distributed` ends them: Ray sees workers that died, whatever their status.
        print("Stopped during the start-up", flush=True)
        return 1 if stuck else 0
    return max(_status(i, run) if run not in stuck else 1 for i, run in enumerate(runs))


def _died(run: ray.ObjectRef) -> bool:
    """Whether the process running `run` ended without returning (its actor's worker died)."""
    try:
        ray.get(run)
    except RayActorError:
        return True
    return False


def _status(process_id: int, run: ray.ObjectRef) -> int:
    """The exit status `run` returned, or 1 (said on stderr) where its process died."""
    try:
        return ray.get(run)
    except RayActorError as error:
        print(f"sluice serve: error: process {process_id} died: {error}", file=sys.stderr, flush=True)
        return 1


def _place(args: argparse.Namespace, coordinator: str, hosts: int, process_id: int) -> argparse.Namespace:
    """`args` for process `process_id` of the job (without --hosts nor --ray-address: each actor runs one process
    of it, on the cluster already)."""
    return argparse.Namespace(**{**vars(args), "hosts": None, "ray_address": None, "coordinator_address": coordinator,
                                 "num_processes": hosts, "process_id": process_id})
