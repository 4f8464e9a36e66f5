"""`sluice serve --hosts 2`: Ray starts the two processes of a multi-process job (two actors in a placement group,
2 simulated CPU devices each), which serve one tensor-parallel model as `--coordinator-address` does by hand; each
runs `sluice serve`'s entry point with its place in the job, through the command's checks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("ray")

import psutil  # Ray's own copy, where no other is installed: importable once Ray is

from sluice.app import serve
from sluice.app.cli import build_parser
from sluice.app.ray_hosts import _place
from test_api_e2e import ROOT, free_port, start_server
from test_ray_cli import _marked_pids
from test_multihost import LIMITS, PROMPT, reference, tiny_model  # noqa: F401 (a fixture)


def test_a_process_of_a_job_on_a_joined_cluster_passes_the_commands_checks(capsys):
    """The process joins no cluster itself (its actor is on one): `--ray-address` without `--hosts` would be refused
    as tuning a mode that is off. Its model is looked for on its own host, where this one is missing."""
    args = build_parser().parse_args(["serve", "--hosts", "2", "--tp", "2", "--ray-address", "10.0.0.7:6379",
                                      "--model", "/nowhere/model.gguf"])
    assert serve.run(_place(args, "10.0.0.7:8476", hosts=2, process_id=1)) == 2
    refusal = capsys.readouterr().err
    assert refusal.startswith("sluice serve: error: ") and "/nowhere/model.gguf" in refusal


# Ray's start-up on top of what tests/test_multihost.py checks by hand: about 25 s on 2 cores.
@pytest.mark.long
def test_two_ray_actors_serve_one_model_like_a_single_process(tiny_model):  # noqa: F811
    server = start_server("--model", str(tiny_model), "--tp", "4", "--hosts", "2", "--no-ui", *LIMITS,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, startup_timeout_s=600)
    try:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1,
        })
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
    finally:
        assert server.stop(timeout_s=120) == 0, server.output()[-4000:]
    assert "running process 0's steps" in server.output()
    assert "Stopping: process 0 finishes its requests in flight" in server.output()

    text, logprobs = reference(tiny_model)
    assert choice["text"] == text
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=1e-4)


@pytest.mark.long
def test_a_signal_while_the_processes_load_stops_the_command_with_0_leaving_nothing(tiny_model):  # noqa: F811
    """Process 0 ends at once, still loading (as a single process does), and the other process with it: Ray sees
    two workers that died, which the command says is the stop's doing; the local cluster ends with it."""
    mark = uuid.uuid4().hex
    server = start_server("--model", str(tiny_model), "--tp", "4", "--hosts", "2", "--no-ui", *LIMITS,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "LEAK_MARK": mark},
                          startup_timeout_s=600, until=503)
    assert server.stop(timeout_s=120) == 0, server.output()[-4000:]
    assert "Stopped during the start-up" in server.output()
    deadline = time.monotonic() + 30
    while left := _marked_pids(mark):
        assert time.monotonic() < deadline, f"processes of the command's cluster outlived it: {left}"
        time.sleep(0.5)


# Each of the two streams below: seconds of process 0's steps on 2 cores, as the prompt leaves room for.
STREAM_TOKENS = 48


async def _streams_across_a_stop(url: str, stop) -> list[list[str]]:
    """Two streamed completions at once (one running, one queued: `LIMITS`' one sequence at a time), their events;
    `stop()` once both have their headers."""
    started = 0

    async def stream(client: httpx.AsyncClient, i: int) -> list[str]:
        nonlocal started
        body = {"prompt": [*PROMPT, i], "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            started += 1
            if started == 2:
                stop()
            return [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        return await asyncio.gather(*(stream(client, i) for i in range(2)))


@pytest.mark.long
@pytest.mark.parametrize("signalled", ["group", "every-process"])
def test_sigterm_to_the_whole_command_drains_process_0_once_and_exits_0(tiny_model, signalled):  # noqa: F811
    """SIGTERM to the command's process group (a supervisor's, `timeout`'s), or to each of its processes (systemd's
    KillMode=control-group), reaches the driver alone: it stops process 0 once, which drains (a second stop would
    cut the streams short), and the other process, told nothing, stays until process 0's shutdown ends it. The
    streams in flight finish and the command exits 0."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="sluice-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    with log.open("wb") as sink:
        command = subprocess.Popen(
            [sys.executable, "-m", "sluice.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--model",
             str(tiny_model), "--tp", "4", "--hosts", "2", "--no-ui", *LIMITS],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if signalled == "group":
            os.killpg(command.pid, signal.SIGTERM)
            return
        for process in [psutil.Process(command.pid), *psutil.Process(command.pid).children(recursive=True)]:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                continue

    try:
        deadline = time.monotonic() + 600
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert command.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        streams = asyncio.run(_streams_across_a_stop(f"http://127.0.0.1:{port}", stop))
        exit_status = command.wait(120)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    output = log.read_text(errors="replace")
    assert exit_status == 0, output[-4000:]
    assert "Stopping: process 0 finishes its requests in flight" in output
    for events in streams:
        assert events[-1] == "data: [DONE]", events[-2:]
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length", events[-2:]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
