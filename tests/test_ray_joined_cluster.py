"""`sluice serve --replicas 2 --ray-address ADDR`: replicas on a cluster the command joins (a `ray start --head`
started here, of one CPU, with an environment of its own and none of the engine's variables). The first replica
runs with the command's engine environment as a local cluster's replica inherits it; the second waits for a CPU
for ever, so the start-up cannot finish, and a signal ends the command all the same; it leaves the cluster as it
found it.

One cluster and one command for the module; the test that stops the command comes last.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

import psutil  # Ray's own copy, where no other is installed: importable once Ray is

from sluice.app.ray_cluster import ENGINE_VARIABLE_PREFIXES
from test_api_e2e import ROOT, SERVER_FLAGS, ServerProcess, free_port, start_server
from test_ray_replicas import ray_processes, replica_pids

pytestmark = pytest.mark.slow

# A joined cluster authenticates its clients (Ray's token mode): the head and the command share a token.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
# Three CPU devices for `--tp 3` (SmolLM2's 3 KV heads), as the command's XLA_FLAGS makes them: the head's node
# has one.
THREE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
# What Sluice leaves running on a cluster it joined, by Ray's process names: Serve's controller and proxy, the
# application's replicas (ingress included).
SERVE_PROCESSES = ("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica")


@dataclass
class Head:
    process: subprocess.Popen
    address: str
    core: dict[str, int]  # the pids of its raylet and GCS


def _core_processes(head: subprocess.Popen) -> dict[str, int]:
    """The pids of the raylet and the GCS a `ray start --head --block` runs, by process name."""
    return {process.name(): process.pid for process in psutil.Process(head.pid).children(recursive=True)
            if process.name() in ("raylet", "gcs_server")}


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A one-node cluster, in a Ray folder of its own: `ray start` writes its address there, where a local
    `ray.init()` elsewhere on the machine would otherwise find and join it."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(ENGINE_VARIABLE_PREFIXES) and name != "RAY_ADDRESS"}
    log = Path(temp_dir) / "head.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={free_port()}",
             "--num-cpus=1", "--include-dashboard=false", f"--dashboard-port={free_port()}",
             f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env={**env, **AUTH}, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while (found := re.search(r"ray start --address='([^']+)'", log.read_text())) is None:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield Head(process, found.group(1), _core_processes(process))
    finally:
        process.terminate()
        process.wait(60)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server(head: Head) -> Iterator[ServerProcess]:
    """Two replicas of a CPU each on the cluster of one: the first serves (/health is 200), the second waits."""
    server = start_server("--replicas", "2", "--tp", "3", "--gpu-memory-utilization", "0.5", "--ray-address",
                          head.address, "--no-ui", *SERVER_FLAGS, env={**AUTH, **THREE_DEVICES}, startup_timeout_s=300)
    yield server
    server.stop(timeout_s=120)  # stopped already, unless the test that stops it was left out


def test_the_replica_gets_the_commands_xla_flags(server: ServerProcess):
    """Its engine sees the three devices the command's XLA_FLAGS makes, which its tensor parallelism needs."""
    reply = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text


def test_the_replica_gets_the_gpu_share_the_command_claims(head: Head, server: ServerProcess):
    """`--gpu-memory-utilization` claims jax's share of each GPU in the command's environment before jax starts;
    the replica's jax must read it there too (on a CPU it has no effect, so it is read from the process)."""
    [replica] = replica_pids(head.process.pid)
    assert b"XLA_CLIENT_MEM_FRACTION=0.5" in Path(f"/proc/{replica}/environ").read_bytes().split(b"\0")


def test_a_second_command_asking_for_another_address_is_told_the_one_ray_serve_keeps(head: Head,
                                                                                     server: ServerProcess):
    """Ray Serve's proxies keep the host and port it started with: a command joining while another serves there
    cannot have its own, and says where Serve listens rather than print a URL nothing answers. The application
    serving there is left alone."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "sluice.app.cli", "serve", "--replicas", "1", "--ray-address", head.address, "--host",
         "127.0.0.1", "--port", str(port), "--no-ui", *SERVER_FLAGS],
        cwd=ROOT, env={**os.environ, **AUTH}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    in_use = server.url.removeprefix("http://")
    assert result.stderr.strip().splitlines()[-1] == (
        f"sluice serve: error: Ray Serve already runs on this cluster, serving HTTP at {in_use}: --host and --port "
        "cannot change that (ask for that address, or stop Ray Serve there first)")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_second_command_at_the_same_address_leaves_the_application_serving_there_alone(head: Head,
                                                                                        server: ServerProcess):
    """Both would be served at one route: deployed again, the application would answer with the second command's
    model at the first's URL, and whichever stopped first would delete it under the other."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    result = subprocess.run(
        [sys.executable, "-m", "sluice.app.cli", "serve", "--replicas", "1", "--ray-address", head.address, "--host",
         host, "--port", port, "--no-ui", *SERVER_FLAGS],
        cwd=ROOT, env={**os.environ, **AUTH}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "sluice serve: error: an application named 'sluice' already serves on this cluster"), result.stderr[-2000:]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_signal_stops_a_start_up_that_cannot_finish_and_the_command_leaves_the_cluster_as_it_found_it(
        head: Head, server: ServerProcess):
    """SIGTERM ends the command, whose second replica still waits for a CPU, all the same. Its application is
    deleted, and Ray Serve, which it started there, is stopped: its proxy would hold the port, and the next
    command's --host and --port would not be applied. The cluster itself goes on, its raylet and GCS the ones it
    had, and answers `ray status`."""
    assert ray_processes(head.process.pid, SERVE_PROCESSES)
    assert server.stop(timeout_s=60) == 0, server.output()[-4000:]
    assert "Sluice is ready" not in server.output()
    _wait_until_serve_is_gone(head)
    assert head.process.poll() is None, "the head's `ray start` ended"
    assert sorted(head.core) == ["gcs_server", "raylet"] and _core_processes(head.process) == head.core
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    status = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", "--address", head.address],
                            env={**env, **AUTH}, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr


def _wait_until_serve_is_gone(head: Head) -> None:
    deadline = time.monotonic() + 60
    while left := ray_processes(head.process.pid, SERVE_PROCESSES):
        assert time.monotonic() < deadline, f"left on the cluster: {left}"
        time.sleep(0.5)
