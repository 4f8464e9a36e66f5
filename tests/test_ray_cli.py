"""`sluice serve --replicas` from the command line with Ray: a replica that cannot load is a one-line error, the
local Ray cluster is the command's own, and a stop drains. Its flags and the stop's parts without a cluster:
tests/test_scale_out_flags.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from test_api_e2e import ROOT, SERVER_FLAGS, ServerProcess, free_port, needs_ipv6, start_server

from test_scale_out_flags import sluice


def _marked_pids(mark: str) -> list[int]:
    """The processes whose environment holds `LEAK_MARK=mark`: a command started with it and all it started."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"LEAK_MARK={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "host", "expected_url"), [
    (signal.SIGINT, "127.0.0.1", "http://127.0.0.1:{port}"),
    pytest.param(signal.SIGTERM, "::1", "http://[::1]:{port}",
                 marks=needs_ipv6),
], ids=["ctrl-c-on-ipv4", "sigterm-on-ipv6"])
def test_a_local_cluster_is_the_commands_own_whatever_ray_address_says_its_ready_url_reaches_it_on_an_ipv4_or_ipv6_host_and_a_signal_to_its_group_leaves_nothing(
        sig: signal.Signals, host: str, expected_url: str):
    """Ray joins the cluster RAY_ADDRESS (or `ray start`) names when asked for none; without --ray-address the
    replicas run on a cluster of their own, all of which stops when a signal to the command's whole process group
    stops the command: Ctrl-C's SIGINT, as a terminal sends it, or SIGTERM, as a supervisor stopping the group
    does (the cluster's processes, in that group too, must leave the stop to the command: else it exits 1 once
    it has waited a minute for Ray's GCS).

    Each life checks on the way that the ready line's URL reaches the replicas (/health answers 200 there), on an
    IPv4 host and on an IPv6 one, whose address the URL writes in brackets (`http://[::1]:port`). (A SIGTERM to
    the command alone, rather than its group, exiting 0 is checked by the drain tests below.)"""
    pytest.importorskip("ray.serve")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": "127.0.0.1:9", "LEAK_MARK": mark}
    server = subprocess.Popen([sys.executable, "-m", "sluice.app.cli", "serve", "--replicas", "1", "--host", host,
                               "--port", str(port), "--no-ui", *SERVER_FLAGS], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (line := server.stdout.readline()).startswith("Sluice is ready: "):
            assert line and time.monotonic() < deadline, "no ready line"
        url = re.match(r"Sluice is ready: (\S+)/v1 ", line).group(1)
        assert url == expected_url.format(port=port)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        os.killpg(server.pid, sig)
        server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert server.returncode == 0
    deadline = time.monotonic() + 30
    while left := _marked_pids(mark):
        assert time.monotonic() < deadline, f"processes of the command's cluster outlived it: {left}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_replica_that_cannot_load_is_a_one_line_error_saying_why():
    """`--tp 2` on one CPU device: the replica's engine refuses to load, each time Ray Serve tries it. Ray Serve
    tries once here rather than its 3 times, each one more replica process failing the same way."""
    pytest.importorskip("ray.serve")
    env = {name: value for name, value in os.environ.items() if name != "XLA_FLAGS"}
    env["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"
    result = sluice("serve", "--replicas", "1", "--tp", "2", "--port", str(free_port()), "--no-ui", *SERVER_FLAGS, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "sluice serve: error: the replicas failed to start: sluice.sharding.mesh.InvalidTensorParallelism: --tp 2 "
        "needs 2 devices but only 1 cpu device(s) are visible")
    assert "Exception during graceful shutdown" not in result.stdout + result.stderr



# The longest Ray Serve waits on its own: a deployment's graceful shutdown where it sets none (20 s), and a
# blocking `serve.delete` (60 s).
RAY_SERVE_WAITS_S = 60


Outcome = tuple[int, list[str]]  # a streamed request's status, and its events (its body if refused)


async def _streams(url: str, count: int, started: asyncio.Event, enough: int | None = None,
                   tokens: int = 500) -> list[Outcome]:
    """`count` streamed completions of `tokens` tokens each, their outcomes; `started` is set once `enough` of them
    (all unless given) have their headers (the replica has them)."""
    answered = 0

    async def stream(client: httpx.AsyncClient, i: int) -> Outcome:
        nonlocal answered
        body = {"prompt": [400 + i, 7, 8], "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            answered += 1
            if answered == (enough or count):
                started.set()
            if response.status_code != 200:
                return response.status_code, [(await response.aread()).decode()]
            return 200, [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        return await asyncio.gather(*(stream(client, i) for i in range(count)))


async def _within(awaitable, timeout_s: float, what: str):
    """`awaitable`'s result, failing the test with `what` was waited for if it takes longer than `timeout_s`."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        pytest.fail(f"waited {timeout_s:.0f} s for {what}")


async def _sigterm_under_streams(server: ServerProcess, count: int, running: int) -> tuple[list[Outcome], float]:
    """`count` streams (`_streams`), and SIGTERM once `running` of them have their headers: their outcomes, and how
    long after the SIGTERM the last one ended."""
    started = asyncio.Event()
    streams = asyncio.ensure_future(_streams(server.url, count, started, running))
    await asyncio.wait_for(started.wait(), 120)
    server.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    return await streams, time.monotonic() - stopped_at


# About 110 s: it must outlast Ray Serve's own 60 s waits; the next test drains streams in the default run.
@pytest.mark.long
def test_sigterm_lets_every_request_in_flight_finish_within_the_drain_timeout():
    """Streams on a replica that runs one at a time: the last ends longer after SIGTERM than Ray Serve waits on its
    own, within --drain-timeout; the ingress relaying them waits for them too."""
    pytest.importorskip("ray.serve")
    server = start_server("--replicas", "1", "--no-ui", *SERVER_FLAGS, "--max-model-len", "512", "--max-num-seqs",
                          "1", "--max-ongoing-requests", "32", "--drain-timeout", "300", startup_timeout_s=300)
    try:
        streams, drained_s = asyncio.run(_sigterm_under_streams(server, 24, 24))
        exit_status = server.process.wait(300)
    finally:
        server.stop()
    assert drained_s > RAY_SERVE_WAITS_S, "the streams ended before it: this shows nothing"
    for _, events in streams:
        assert events[-1] == "data: [DONE]", events[-2:]
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert exit_status == 0, server.output()[-4000:]


# What a stop takes beyond the drain timeout: the requests it ends saying so, the replicas' and the ingress's own
# shutdown, Ray's (3.2 s on 2 cores).
STOP_MARGIN_S = 7
# Short, so that the streams below outlast it; longer than the margin, so that a stop waiting for the replicas a
# second drain timeout takes longer than the two together.
SHORT_DRAIN_S = 8


@pytest.mark.slow
def test_a_stop_takes_one_drain_timeout_and_ends_the_requests_left_with_the_drains_503():
    """Six streams on a replica that runs one at a time and takes two (the others wait at the ingress) outlast
    --drain-timeout: once it has passed, a stream still running ends with the drain's error event, one still
    waiting for the replica gets the drain's 503, and the command exits soon after: the replicas, idle by then, are
    not waited for a second drain timeout."""
    pytest.importorskip("ray.serve")
    server = start_server("--replicas", "1", "--no-ui", *SERVER_FLAGS, "--max-model-len", "512", "--max-num-seqs",
                          "1", "--drain-timeout", str(SHORT_DRAIN_S), startup_timeout_s=300)
    try:
        outcomes, ended_s = asyncio.run(_sigterm_under_streams(server, 6, 2))
        exiting_at = time.monotonic()
        exit_status = server.process.wait(120)
        stop_s = ended_s + time.monotonic() - exiting_at
    finally:
        server.stop()
    assert exit_status == 0, server.output()[-4000:]
    assert stop_s < SHORT_DRAIN_S + STOP_MARGIN_S, server.output()[-4000:]
    shutting_down = "The server is shutting down"
    refused = [json.loads(events[0])["error"]["message"] for status, events in outcomes if status == 503]
    streamed = [events for status, events in outcomes if status == 200]
    assert len(refused) + len(streamed) == 6 and set(refused) == {shutting_down}, outcomes
    assert all(events[-1] == "data: [DONE]" for events in streamed)
    last = [json.loads(events[-2][len("data: "):]) for events in streamed]
    assert shutting_down in [event["error"]["message"] for event in last if "error" in event], outcomes


def _answer_of_the_ingress(url: str, path: str, deadline: float) -> httpx.Response:
    """The first answer to GET `path` that the ingress gives (JSON), not Ray's proxy (plain text, before the
    ingress runs); each comes at once: a request left waiting raises."""
    while (response := httpx.get(f"{url}{path}", timeout=5)).headers["content-type"] != "application/json":
        assert time.monotonic() < deadline, f"only Ray's proxy answered {path}: {response.text}"
        time.sleep(0.2)
    return response


async def _refused_while_draining(url: str) -> dict[str, httpx.Response]:
    """Once SIGTERM has reached the server: the first answer to /health that is not 200 (the ingress answers it at
    once, whatever the replicas are doing: the drain has begun), then a `GET /v1/models`'s and a Messages
    request's, sent after it: neither waits for a replica busy with the streams."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        while (health := await client.get(f"{url}/health")).status_code == 200:
            await asyncio.sleep(0.05)
        models = await client.get(f"{url}/v1/models")
        messages = await client.post(f"{url}/v1/messages", json={
            "model": "any", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
        return {"models": models, "messages": messages, "health": health}


# Each of the three streams below: enough for the drain to outlast the new requests' answers by seconds (the three
# take about 7 s on 2 cores, one after another), which the test checks.
DRAINED_STREAM_TOKENS = 200


@pytest.mark.slow
def test_health_is_503_while_the_replicas_load_then_200_and_after_sigterm_new_requests_get_the_single_processs_503_while_the_streams_in_flight_finish():
    """One server's life, on a replica that runs one at a time (and takes two: its batch twice):

    - while the replica loads, /health is 503 ("loading"), answered at once by the ingress; once it runs, 200;
    - three streams: two at the replica (one running, one queued there), the third waiting at the ingress for it;
      SIGTERM then starts the drain, and they keep it going (seconds each) while new requests come:
    - those new requests get the single process's 503 at once: /health "shutting down", then GET /v1/models "The
      server is shutting down" and a Messages request an Anthropic-shaped error;
    - every stream in flight at the SIGTERM, at the replica or waiting at the ingress, finishes (finish_reason
      "length", then `data: [DONE]`), well within --drain-timeout;
    - the command exits 0."""
    pytest.importorskip("ray.serve")
    server = start_server("--replicas", "1", "--no-ui", *SERVER_FLAGS, "--max-model-len", "512", "--max-num-seqs",
                          "1", "--drain-timeout", "120", until=503, startup_timeout_s=300)

    async def stream_then_stop() -> tuple[list[Outcome], dict[str, httpx.Response], bool]:
        started = asyncio.Event()
        streams = asyncio.ensure_future(_streams(server.url, 3, started, 2, DRAINED_STREAM_TOKENS))
        await _within(started.wait(), 120, "two of the streams to have their headers from the replica")
        server.process.send_signal(signal.SIGTERM)
        refused = await _within(_refused_while_draining(server.url), 60, "a 503 to a new request after SIGTERM")
        streaming = not streams.done()
        return await streams, refused, streaming

    try:
        deadline = time.monotonic() + 300
        loading = _answer_of_the_ingress(server.url, "/health", deadline)
        assert (loading.status_code, loading.json()["error"]["message"]) == (503, "loading")
        while (health := _answer_of_the_ingress(server.url, "/health", deadline)).status_code != 200:
            assert time.monotonic() < deadline, f"/health still {health.status_code} after 300 s: {health.text}"
            time.sleep(0.2)
        streams, refused, streaming = asyncio.run(stream_then_stop())
        exit_status = server.process.wait(120)
    finally:
        server.stop(timeout_s=120)
    assert streaming, "the streams had ended before the new requests were answered: this shows nothing"
    assert refused["models"].status_code == 503, refused["models"].text
    assert refused["models"].json()["error"]["message"] == "The server is shutting down"
    assert refused["messages"].status_code == 503
    assert refused["messages"].json()["type"] == "error"  # Anthropic's shape
    assert (refused["health"].status_code, refused["health"].json()["error"]["message"]) == (503, "shutting down")
    assert [status for status, _ in streams] == [200] * 3, streams
    for _, events in streams:
        assert events[-1] == "data: [DONE]", events[-2:]
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length", events[-2:]
    assert exit_status == 0, server.output()[-4000:]
