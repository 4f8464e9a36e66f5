"""Readers that open a stream and then stop reading: the server's memory stays bounded while they stall, and
after `--stream-stall-timeout` their requests are aborted, their KV pages freed and their connections closed.

Each reader is a raw socket with a 4 KiB receive buffer that sends a streaming chat request with a large
`max_tokens` (and top-20 logprobs, so each event is ~1 KiB and the TCP window fills within a few hundred
tokens), then never reads. `SLUICE_STALLED_READERS=200` runs the issue's 200 (the default, 32, keeps the test
near a minute on two cores):

    SLUICE_STALLED_READERS=200 .venv/bin/python -m pytest -q tests/test_stalled_readers.py
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import asyncio

import httpx
import pytest

from sluice.batching.outputs import Collector, Increment, TokenLogprob, Usage

from test_api_e2e import metric, start_server, wait_for_metric

pytestmark = pytest.mark.slow

NUM_READERS = int(os.environ.get("SLUICE_STALLED_READERS", "32"))
STALL_TIMEOUT_S = 4
# What the stalled readers may add to the server's RSS: their increments (bounded by max_tokens), the asyncio
# write buffers (64 KiB each at most) and the per-request state, with room for the allocator's slack.
RSS_BOUND_BYTES = 64 * 2**20 + NUM_READERS * 2**20
COMPLETED = 'sluice_e2e_request_latency_seconds_count{outcome="success"}'

# With its warm-up: programs compiled while readers stall would count in the RSS bound. 64 tokens a step (the CPU's
# default is 512) still admit the readers' prompts a few a step, and leave 3 step sizes to compile, not 6.
FLAGS = ["--stream-stall-timeout", str(STALL_TIMEOUT_S), "--max-num-seqs", "32", "--max-num-batched-tokens", "64",
         "--max-model-len", "1024", "--kv-cache-memory", "512MiB", "--sse-keepalive", "1"]


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_stalled_reader(url: str, index: int) -> socket.socket:
    """Sends a streaming chat request on a socket whose receive buffer is 4 KiB, and never reads it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect: a small window, and a small MSS, which keeps the server's send buffer from growing to
    # megabytes (the kernel sizes it by segments, and loopback's are 64 KiB).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Reader {index}: count to a thousand."}],
        "max_tokens": 500, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20,
    }).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def read_to_end(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def test_increments_nobody_takes_are_joined_per_choice_in_order():
    async def scenario() -> list[Increment]:
        collector = Collector("r", num_choices=2)
        for step in range(500):
            for choice in (0, 1):
                collector.put(Increment(choice, f"{step},", (step,), (TokenLogprob(step, -1.0),)))
        collector.put(Increment(0, "", (), finish_reason="length"))
        collector.put(Increment(1, "", (), finish_reason="length", usage=Usage(3, 1000)))
        assert sum(len(parts) for parts in collector._pending.values()) < 2 * 64
        return [increment async for increment in collector]

    taken = asyncio.run(scenario())
    assert [i.choice for i in taken] == [0, 1] and taken[-1].usage == Usage(3, 1000)
    for increment in taken:
        assert increment.text == "".join(f"{step}," for step in range(500))
        assert increment.token_ids == tuple(range(500)) and len(increment.logprobs) == 500
        assert increment.finish_reason == "length"


def test_stalled_readers_stay_bounded_then_are_aborted_and_their_pages_freed(server):
    assert httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).status_code == 200
    baseline = rss_bytes(server.process.pid)
    completed_before = metric(server.url, COMPLETED)
    readers = [open_stalled_reader(server.url, i) for i in range(NUM_READERS)]

    def ended() -> tuple[int, int]:
        return (int(metric(server.url, "sluice_stream_stalls_total")),
                int(metric(server.url, COMPLETED) - completed_before))

    try:
        peak = baseline
        deadline = time.monotonic() + 60 + 5 * NUM_READERS  # they run --max-num-seqs at a time
        while sum(ended()) < NUM_READERS and time.monotonic() < deadline:
            peak = max(peak, rss_bytes(server.process.pid))
            time.sleep(0.25)
        stalled, completed = ended()
        print(f"\n{NUM_READERS} stalled readers ({stalled} aborted, {completed} completed into the kernel's buffers): "
              f"RSS {baseline / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB (growth "
              f"{(peak - baseline) / 2**20:.0f} MiB, bound {RSS_BOUND_BYTES / 2**20:.0f} MiB)")
        # A stream whose whole output fits the socket buffers the kernel grew for it completes; the rest stall.
        assert stalled + completed == NUM_READERS and stalled >= NUM_READERS // 2
        assert peak - baseline < RSS_BOUND_BYTES
        assert wait_for_metric(server.url, "sluice_kv_pages_used", 0) == 0
        assert wait_for_metric(server.url, "sluice_num_requests_running", 0) == 0
        if stalled == NUM_READERS:  # else reader 0 may have completed, its connection kept alive
            # Once the reader reads again, what was written drains and the connection closes without [DONE].
            received = read_to_end(readers[0], timeout_s=30)
            assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        for sock in readers:
            sock.close()
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
