"""A real `sluice serve` through its life: 503 while loading, 429 when the queue is full, SIGTERM drain.

Its own server (one batch slot, one waiting slot), since the drain test ends the process.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from test_api_e2e import start_server

pytestmark = pytest.mark.slow

FLAGS = ["--max-num-seqs", "1", "--max-waiting", "1", "--max-num-batched-tokens", "64", "--max-model-len", "256",
         "--kv-cache-memory", "16MiB",
         "--drain-timeout", "120"]


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


class OpenStream:
    """A streaming completion kept open until `close()`.

    Its one line iterator must stay referenced: dropping a half-read iterator closes the connection,
    which the server rightly takes as the client leaving.
    """

    def __init__(self, http: httpx.Client, max_tokens: int = 200) -> None:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert self.response.status_code == 200
        self._events = (line[len("data: "):] for line in self.response.iter_lines() if line.startswith("data: "))

    def next_event(self) -> str:
        return next(self._events)

    def rest(self) -> list[str]:
        return list(self._events)

    def close(self) -> None:
        self.response.close()


def test_health_is_503_while_the_model_loads_then_200(server):
    assert server.health_statuses[0] == 503 and server.health_statuses[-1] == 200


def test_a_server_stopped_while_the_model_loads_exits_0_at_once():
    """The load thread is still in XLA's C++ then: the process must not wait for it, nor abort under it."""
    loading = start_server(*FLAGS, until=503)
    assert loading.stop(timeout_s=30) == 0, loading.output()
    assert "not rethrown" not in loading.output()


def test_full_waiting_queue_answers_429_with_retry_after(server, http):
    running, waiting = OpenStream(http), OpenStream(http)
    try:
        running.next_event()
        rejected = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert rejected.status_code == 429
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["type"] == "rate_limit_error"
    finally:
        running.close()
        waiting.close()
    # The server learns that the streams closed when it next reads or writes them, which a loaded machine may
    # take longer to do than this client takes to send the next request.
    deadline = time.monotonic() + 30
    while (admitted := httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  timeout=120)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert admitted.status_code == 200


def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits_0(server, http):
    in_flight = OpenStream(http, max_tokens=48)
    in_flight.next_event()
    server.process.send_signal(signal.SIGTERM)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert refused.status_code == 503
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 503
    rest = in_flight.rest()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(120) == 0
