"""`sluice serve --hosts H`: one Sluice engine whose tensor parallelism spans H processes, one per host, as Ray actors.

The multi-process serving of `--coordinator-address/--num-processes/--process-id` (`sharding/mesh.py`: process 0
serves HTTP and schedules, the others run its steps), started by Ray instead of by hand: a placement group of H
bundles (spread over the cluster's nodes where it has that many; each bundle the host's share of `--tp` GPUs, or a
CPU), one `SluiceProcess` actor per bundle, `jax.distributed` initialized with process 0's actor as coordinator
(an address it picks on its own node). The first SIGTERM/SIGINT is passed on to process 0, which drains as the
single process does; its shutdown ends the others' step loops.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sluice.app.addresses import host_port
from sluice.app.ray_cluster import connect, disconnect, stop_on_signal

# `sluice serve`'s entry point for one process, given by its caller (app/serve.py imports this module).
ServeProcess = Callable[[argparse.Namespace], int]


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
        return run(args)


@ray.remote(num_cpus=0)
def _terminate(pid: int) -> None:
    """SIGTERM to `pid`, from a task placed on that process's node."""
    os.kill(pid, signal.SIGTERM)


def serve_on_hosts(run: ServeProcess, args: argparse.Namespace, hosts: int, gpus_per_host: int) -> int:
    """Runs `args` (a parsed `sluice serve` command line) with `run` as `hosts` processes; the worst exit status.

    `gpus_per_host`: each process's GPUs on a cluster with GPUs (0: a CPU each).
    """
    connect(args.ray_address, hosts)
    if ray.cluster_resources().get("GPU", 0) == 0:
        gpus_per_host = 0
    bundle = {"CPU": 1, "GPU": gpus_per_host} if gpus_per_host else {"CPU": 1}
    group = placement_group([bundle] * hosts, strategy="SPREAD")
    try:
        ray.get(group.ready())
        return _run(run, args, hosts, group, gpus_per_host)
    finally:
        remove_placement_group(group)
        disconnect()


def _run(run: ServeProcess, args: argparse.Namespace, hosts: int, group: PlacementGroup, gpus_per_host: int) -> int:
    def placed(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

    processes = [SluiceProcess.options(scheduling_strategy=placed(i), num_cpus=1, num_gpus=gpus_per_host).remote()
                 for i in range(hosts)]
    coordinator = ray.get(processes[0].coordinator_address.remote())
    leader_pid = ray.get(processes[0].pid.remote())
    runs = [process.serve.remote(run, _place(args, coordinator, hosts, i)) for i, process in enumerate(processes)]
    with stop_on_signal() as stop:
        while not stop.is_set() and not ray.wait([runs[0]], timeout=0.5)[0]:
            pass
        if stop.is_set():
            ray.get(_terminate.options(scheduling_strategy=placed(0)).remote(leader_pid))
        # Process 0's shutdown ends the others' step loops; one that is still running after a minute is stuck.
        _, stuck = ray.wait(runs, num_returns=len(runs), timeout=60)
        for process, run in zip(processes, runs):
            if run in stuck:
                ray.kill(process)
        return max(ray.get(run) if run not in stuck else 1 for run in runs)


def _place(args: argparse.Namespace, coordinator: str, hosts: int, process_id: int) -> argparse.Namespace:
    """`args` for process `process_id` of the job (without --hosts nor --ray-address: each actor runs one process
    of it, on the cluster already)."""
    return argparse.Namespace(**{**vars(args), "hosts": None, "ray_address": None, "coordinator_address": coordinator,
                                 "num_processes": hosts, "process_id": process_id})
