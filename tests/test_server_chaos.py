"""Hostile clients against one real `sluice serve`: clients that leave at random moments in every API (before the
first token, while queued behind a full batch, between keep-alive comments, mid-stream), readers that stop
reading, bodies that never finish arriving, and a SIGTERM with streams open. After each storm the server must be
whole: no request running or waiting, no KV page held, no admission held, no thread or file descriptor gained,
and a greedy request answers as before.

A held admission is seen by one request of `n` = --max-num-seqs + --max-waiting sequences: it is admitted only
while nothing else is in flight (429 otherwise).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from test_api_e2e import ServerProcess, metric, start_server

pytestmark = pytest.mark.slow

MAX_NUM_SEQS, MAX_WAITING, STALL_TIMEOUT_S = 4, 4, 2
FLAGS = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING), "--max-num-batched-tokens", "128",
         "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--sse-keepalive", "0.3",
         "--stream-stall-timeout", str(STALL_TIMEOUT_S), "--drain-timeout", "1", "--no-ui"]
GAUGES = ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_num_seqs_running",
          "sluice_num_seqs_waiting", "sluice_kv_pages_used")
MODEL = "SmolLM2-135M-Instruct.Q4_1"
COUNT = "Count to one hundred."
# Every API, streamed and whole, each long enough to be cut mid-way and queued behind a full batch.
REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 60, "ignore_eos": True,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COUNT}], "max_tokens": 60, "n": 2}),
    ("/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 60, "ignore_eos": True, "stream": True, "n": 2}),
    ("/v1/completions", {"prompt": ["1,", "a,"], "max_tokens": 60, "ignore_eos": True}),
    ("/v1/responses", {"input": COUNT, "max_output_tokens": 60, "stream": True, "store": True}),
    ("/v1/responses", {"input": COUNT, "max_output_tokens": 60, "stream": True, "store": False}),
    ("/v1/responses", {"input": COUNT, "max_output_tokens": 60, "store": True}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": COUNT}], "max_tokens": 60,
                      "stream": True}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": COUNT}], "max_tokens": 60}),
]


@dataclass(frozen=True)
class Baseline:
    """What a served server (its worker threads started) answers greedily, and its threads and open files."""

    answer: str
    threads: int
    files: int


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerProcess, Baseline]]:
    """One server for the module (its last test stops it with a SIGTERM), and its baseline."""
    server = start_server(*FLAGS)
    burst = [threading.Thread(target=greedy, args=(server,)) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
    for thread in burst:
        thread.start()
    for thread in burst:
        thread.join()
    yield server, Baseline(greedy(server), *threads_and_files(server.process.pid))
    server.stop()


def greedy(server) -> str:
    reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "The capital of Germany is", "max_tokens": 16, "temperature": 0})
    return reply.json()["choices"][0]["text"]


def threads_and_files(pid: int) -> tuple[int, int]:
    threads = int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE).group(1))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def send_request(server, path: str, body: dict | bytes, rcvbuf: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: a small window, and small segments, so the server's sends fill it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def leave(sock: socket.socket, reset: bool) -> None:
    """Closes the connection: a FIN, or a RST (SO_LINGER 0), as a killed client's kernel sends."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def admitted_alone(server) -> bool:
    """Whether a request as large as the batch and the queue together is admitted: only while nothing is."""
    reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 1, "n": MAX_NUM_SEQS + MAX_WAITING})
    assert reply.status_code in (200, 429), reply.text
    return reply.status_code == 200


def assert_whole(server: ServerProcess, before: Baseline) -> None:
    deadline = time.monotonic() + 30
    while (held := {name: metric(server.url, name) for name in GAUGES}) != dict.fromkeys(GAUGES, 0):
        assert time.monotonic() < deadline, held
        time.sleep(0.1)
    assert admitted_alone(server)
    assert greedy(server) == before.answer
    # A closed connection's descriptor goes once the server has seen it close, which a loaded machine delays.
    deadline = time.monotonic() + 30
    while not settled(now := threads_and_files(server.process.pid), before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled(now, before), (now, before)


def settled(now: tuple[int, int], before: Baseline) -> bool:
    """Whether the server holds no more threads and no more file descriptors than `before` (each on its own: a
    tuple's comparison would let fewer threads hide more descriptors)."""
    return now[0] <= before.threads and now[1] <= before.files


def test_clients_that_leave_at_random_moments_in_every_api_leave_nothing_behind(served):
    server, before = served
    rng = random.Random(7)
    # Three times the batch and queue: the later ones are refused (429) or wait behind a full batch, and are left
    # while they wait, between keep-alive comments, before their first token or mid-way.
    plans = [(*rng.choice(REQUESTS), rng.uniform(0, 1.5), rng.random() < 0.5) for _ in range(24)]

    def client(path: str, body: dict, stay_s: float, reset: bool) -> None:
        sock = send_request(server, path, body)
        time.sleep(stay_s)
        leave(sock, reset)

    clients = [threading.Thread(target=client, args=plan) for plan in plans]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert_whole(server, before)


def test_readers_that_stop_reading_are_ended_at_the_stall_limit_even_after_their_last_event(served):
    """A Responses stream's last event holds the whole response (here with its top logprobs): a reader that
    stops as it goes out blocks the stream's final send, which the stall limit must end too. Which length fills
    the socket just then depends on the kernel's buffers: the readers span a range of them."""
    server, before = served
    stalls_before = metric(server.url, "sluice_stream_stalls_total")
    readers = [send_request(server, "/v1/responses", {"input": COUNT, "max_output_tokens": tokens,
                                                      "top_logprobs": 20, "stream": True, "store": False},
                            rcvbuf=4096) for tokens in range(16, 44, 4)]
    readers.append(send_request(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": COUNT}], "max_tokens": 200, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 20}, rcvbuf=4096))
    try:
        deadline = time.monotonic() + 60
        while not admitted_alone(server):  # the readers are still connected, none reading
            assert time.monotonic() < deadline, "a reader that reads nothing still holds its admission"
            time.sleep(0.5)
        assert metric(server.url, "sluice_stream_stalls_total") > stalls_before
    finally:
        for sock in readers:
            sock.close()
    assert_whole(server, before)


def test_concurrent_requests_of_several_samples_get_their_own_tokens_while_others_are_cancelled(served):
    server, before = served
    def sampled(seed: int, stream: bool) -> dict[int, str]:
        body = {"prompt": f"Story {seed}: once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": seed,
                "n": 2, "stream": stream}
        if not stream:
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return {choice["index"]: choice["text"] for choice in reply.json()["choices"]}
        texts: dict[int, str] = {}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[len("data: "):])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        return texts

    seeds = range(3)  # 6 sequences, and 2 cancelled: the batch and the queue, full
    alone = {seed: sampled(seed, stream=False) for seed in seeds}
    together: dict[int, dict[int, str]] = {}

    def cancelled(index: int) -> None:
        sock = send_request(server, "/v1/completions", {"prompt": f"Other {index}", "max_tokens": 40,
                                                        "stream": index % 2 == 0})
        time.sleep(0.3 + 0.3 * index)
        leave(sock, reset=index % 2 == 1)

    threads = [threading.Thread(target=lambda s=seed: together.__setitem__(s, sampled(s, stream=s % 2 == 0)))
               for seed in seeds] + [threading.Thread(target=cancelled, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
    assert_whole(server, before)


def test_bodies_that_never_finish_arriving_hold_nothing_and_a_slow_one_is_served(served):
    server, before = served
    for index in range(6):
        sock = send_request(server, "/v1/chat/completions", b"")
        sock.sendall(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10')  # and no more
        time.sleep(0.05)
        leave(sock, reset=index % 2 == 1)
    body = json.dumps({"prompt": "The capital of Germany is", "max_tokens": 16, "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for start in range(0, len(body), 16):
            sock.sendall(body[start:start + 16])
            time.sleep(0.02)
        sock.settimeout(60)
        head, _, rest = sock.recv(1 << 16).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
    assert_whole(server, before)


def test_sigterm_with_requests_open_answers_each_and_exits_0(served):
    """Last: it ends the module's server. The requests still running or queued when the drain runs out (1 s, too
    short for their 400 tokens) are aborted: each stream ends with the abort's error event and [DONE], a request
    not streamed gets its 503; a client that left meanwhile and a reader that stopped reading do not hold the
    shutdown up."""
    server, _ = served
    ended: dict[int, list[str]] = {}
    whole: list[httpx.Response] = []

    def stream(index: int) -> None:
        body = {"prompt": f"{index}, {index + 1},", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            ended[index] = [line for line in reply.iter_lines() if line.startswith("data: ")][-2:]

    def not_streamed() -> None:
        whole.append(httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "x", "max_tokens": 400, "ignore_eos": True}))

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(MAX_NUM_SEQS + MAX_WAITING - 3)]
    clients.append(threading.Thread(target=not_streamed))
    for thread in clients:
        thread.start()
    gone = send_request(server, "/v1/completions", {"prompt": "x", "max_tokens": 200, "stream": True})
    stalled = send_request(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": COUNT}], "max_tokens": 400, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)
    time.sleep(1)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    leave(gone, reset=True)
    try:
        for thread in clients:
            thread.join()
        assert server.process.wait(60) == 0
    finally:
        stalled.close()
    assert time.monotonic() - started < 20
    assert len(ended) == len(clients) - 1
    for events in ended.values():
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][len("data: "):])["error"]["code"] == "aborted"
    assert [(reply.status_code, reply.json()["error"]["code"]) for reply in whole] == [(503, "aborted")]
