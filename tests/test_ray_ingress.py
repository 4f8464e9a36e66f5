"""The scale-out ingress (`app/ingress.py`) without a cluster: a stand-in for the replicas' handle, so that what it
answers on its own (/health, the drain's 503s) and what it does with a request waiting for a replica when the
drain begins or ends can be set up exactly. Beside it, the single process's answers it must match."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

pytest.importorskip("ray.serve")

from sluice.app.anthropic_errors import is_anthropic_path
from sluice.app.ingress import SluiceIngress
from sluice.app.replicas import ResponseStart
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState


def test_the_messages_api_is_its_path_and_every_path_under_it():
    assert is_anthropic_path("/v1/messages")
    assert is_anthropic_path("/v1/messages/count_tokens")
    assert is_anthropic_path("/v1/messages/")
    assert is_anthropic_path("/v1/messages/batches")
    assert not is_anthropic_path("/v1/messagesx")
    assert not is_anthropic_path("/v1/chat/completions")


def test_a_messages_path_sluice_does_not_serve_gets_anthropics_error_and_request_id():
    """The anthropic client reads both off its 404: the shape of the error and the `request-id` header."""
    client = TestClient(create_app(ServerState(ServerSettings(ui=False))))
    answer = client.post("/v1/messages/batches", json={})
    assert answer.status_code == 404 and answer.json()["type"] == "error"
    assert answer.headers["request-id"] == answer.headers["x-request-id"]


class Replicas:
    """The replicas' handle: each call's stream waits for `admit` (a replica free for it), then answers 200 with
    `body`. `calls` counts the calls made."""

    def __init__(self, body: bytes = b"answered") -> None:
        self.admit = asyncio.Event()
        self.body = body
        self.calls = 0

    def options(self, **_: Any) -> Replicas:
        return self

    def remote(self, *_: Any) -> Stream:
        self.calls += 1
        return Stream(self)


class Stream:
    """One call's stream, as `DeploymentResponseGenerator` behaves: `cancel()` makes the next item raise."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas
        self._items = [ResponseStart(200, ((b"content-type", b"text/plain"),), "replica-1"), replicas.body]
        self._cancelled = asyncio.Event()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        waits = [asyncio.ensure_future(self._replicas.admit.wait()), asyncio.ensure_future(self._cancelled.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self._cancelled.is_set():
            raise asyncio.CancelledError  # what a cancelled call raises (Ray Serve's RequestCancelledError is one)
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> None:
        self._cancelled.set()


async def answer(ingress: SluiceIngress, method: str, path: str) -> tuple[int, bytes]:
    """The ingress's answer to a request without a body: its status and body."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": []}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await (await ingress(Request(scope, receive)))(scope, receive, send)
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:])


def test_the_ingresss_health_says_what_the_single_processs_says_loading_and_draining():
    state = ServerState(ServerSettings(ui=False))
    single = TestClient(create_app(state))

    async def ingress_health(drained: bool) -> tuple[int, Any]:
        ingress = SluiceIngress(Replicas(), ServerSettings())  # its stand-in handle lists no replica running
        if drained:
            await ingress.drain(0)
        status, body = await answer(ingress, "GET", "/health")
        return status, json.loads(body)

    loading = single.get("/health")
    assert asyncio.run(ingress_health(drained=False)) == (loading.status_code, loading.json())
    state.begin_drain()
    draining = single.get("/health")
    assert asyncio.run(ingress_health(drained=True)) == (draining.status_code, draining.json())
    assert (loading.json()["error"]["message"], draining.json()["error"]["message"]) == ("loading", "shutting down")
