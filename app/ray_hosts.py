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
import socket
import sys
import threading
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sluice.app.addresses import host_port
from sluice.app.ray_cluster import connect, disconnect, stop_on_signal

# `sluice serve`'s entry point for one process, given by its caller (app/serve.py imports this module); it hands
# process 0's stop (`Stop`) to its second argument before the model loads.
Stop = Callable[[], bool]
ServeProcess = Callable[[argparse.Namespace, Callable[[Stop], None]], int]
# How long the processes get to end once process 0 has ended or been told to stop: its shutdown ends the others'
# step loops at once.
FOLLOWERS_S = 60.0


@ray.remote(concurrency_groups={"stop": 1})
class SluiceProcess:
    """One process of the job: `serve` runs `sluice serve`'s entry point with this process's place in it, and `stop`,
    on a thread of its own meanwhile, stops process 0 as a first signal stops a single process.

    The processes take no signal themselves: a local cluster's inherit SIGTERM blocked (`connect`), and uvicorn
    listens for none off the main thread, where Ray runs the methods of an actor with concurrency groups. A signal
    to the command's process group, or to each of its processes (systemd's), thus reaches the driver alone, which
    stops process 0 once; the others stay up until its shutdown ends their step loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop_server: Stop | None = None  # process 0's, once its server is up
        self._stopped = False  # told to stop, maybe before its server was up
        self._ended = False  # `run` returned: its server's loop is closed

    def coordinator_address(self) -> str:
        """host:port on this actor's node where `jax.distributed`'s coordinator can listen."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return host_port(ray.util.get_node_ip_address(), port)

    def serve(self, run: ServeProcess, args: argparse.Namespace) -> int:
        try:
            return run(args, self._serving)
        finally:
            with self._lock:
                self._ended = True

    def _serving(self, stop_server: Stop) -> None:
        with self._lock:
            self._stop_server = stop_server
            if self._stopped:  # before the server was up: it stops as it comes, still loading
                stop_server()

    @ray.method(concurrency_group="stop")
    def stop(self) -> bool:
        """Stops process 0 as a first signal does (its server drains, once however often asked); whether it was still
        loading the model, which then ends it at once (and the others, whose `jax.distributed` it coordinates)."""
        with self._lock:
            self._stopped = True
            if self._stop_server is None or self._ended:
                return not self._ended
            try:
                return self._stop_server()
            except RuntimeError:  # its loop has closed: `run` is returning
                return False


def serve_on_hosts(run: ServeProcess, args: argparse.Namespace, hosts: int, gpus_per_host: int) -> int:
    """Runs `args` (a parsed `sluice serve` command line) with `run` as `hosts` processes; the worst exit status.

    `gpus_per_host`: each process's GPUs on a cluster with GPUs (0: a CPU each).
    """
    cluster = connect(args.ray_address, hosts)
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
        disconnect(cluster)


def _run(run: ServeProcess, args: argparse.Namespace, hosts: int, group: PlacementGroup, gpus_per_host: int,
         stop: threading.Event) -> int:
    def placed(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

    processes = [SluiceProcess.options(scheduling_strategy=placed(i), num_cpus=1, num_gpus=gpus_per_host).remote()
                 for i in range(hosts)]
    coordinator = ray.get(processes[0].coordinator_address.remote())
    runs = [process.serve.remote(run, _place(args, coordinator, hosts, i)) for i, process in enumerate(processes)]
    while not stop.is_set() and not ray.wait([runs[0]], timeout=0.5)[0]:
        pass
    loading = False
    if stop.is_set():
        print("Stopping: process 0 finishes its requests in flight", flush=True)
        with contextlib.suppress(RayActorError):  # it died meanwhile, which its run says
            loading = ray.get(processes[0].stop.remote())
    # Process 0's shutdown ends the others' step loops; one that is still running a while later is stuck.
    _, stuck = ray.wait(runs, num_returns=len(runs), timeout=FOLLOWERS_S)
    for i, (process, run) in enumerate(zip(processes, runs)):
        if run in stuck:
            print(f"sluice serve: error: process {i} was still running {FOLLOWERS_S:.0f} s after "
                  f"{'the stop' if stop.is_set() else 'process 0 ended'}: killed", file=sys.stderr, flush=True)
            ray.kill(process)
    if loading and runs[0] not in stuck and _died(runs[0]):
        # Stopped before its model was ready, process 0 ended at once (as a single process does), and the others'
        # `jax.distributed` with it: their deaths are its doing, a status they returned first is theirs.
        print("Stopped during the start-up", flush=True)
        return max((1 if run in stuck else _status(i, run, died=0) for i, run in enumerate(runs) if i > 0), default=0)
    return max(1 if run in stuck else _status(i, run) for i, run in enumerate(runs))


def _died(run: ray.ObjectRef) -> bool:
    """Whether the process running `run` ended without returning (its actor's worker died)."""
    try:
        ray.get(run)
    except RayActorError:
        return True
    except RayError:  # it raised, which `_status` says
        pass
    return False


def _status(process_id: int, run: ray.ObjectRef, died: int | None = None) -> int:
    """The exit status `run` returned, or 1 (said in one line on stderr) where its process died or it raised; `died`
    where its process died, if given."""
    try:
        return ray.get(run)
    except RayActorError as error:
        if died is not None:
            return died
        what = f"died: {error}"
    except RayTaskError as error:
        what = f"raised {type(error.cause).__name__}: {error.cause}"
    except RayError as error:
        what = f"failed: {error}"
    print(f"sluice serve: error: process {process_id} {' '.join(what.split())}", file=sys.stderr, flush=True)
    return 1


def _place(args: argparse.Namespace, coordinator: str, hosts: int, process_id: int) -> argparse.Namespace:
    """`args` for process `process_id` of the job (without --hosts nor --ray-address: each actor runs one process
    of it, on the cluster already)."""
    return argparse.Namespace(**{**vars(args), "hosts": None, "ray_address": None, "coordinator_address": coordinator,
                                 "num_processes": hosts, "process_id": process_id})
