"""The scale-out ingress (`app/ingress.py`) without a cluster: a stand-in for the replicas' handle, so that what it
answers on its own (/health, the drain's 503s) and what it does with a request waiting for a replica when the
drain begins or ends can be set up exactly. Beside it, the single process's answers it must match."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.testclient import TestClient
from starlette.types import Scope

pytest.importorskip("ray.serve")

from ray.serve.exceptions import RequestCancelledError

from sluice.app.anthropic_errors import is_anthropic
from sluice.app import ingress as ingress_module
from sluice.app.ingress import SluiceIngress
from sluice.app.prefix_router import Routing
from sluice.app.replicas import ForwardedRequest, ResponseStart
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState


def request(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": headers or []}


def test_anthropics_requests_are_the_messages_apis_paths_and_any_that_carries_anthropic_version():
    assert all(is_anthropic(request(path)) for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/",
                                                         "/v1/messages/batches"))
    assert not any(is_anthropic(request(path)) for path in ("/v1/messagesx", "/v1/chat/completions", "/v1/models"))
    assert is_anthropic(request("/v1/models/x", [(b"anthropic-version", b"2023-06-01")]))


def test_a_messages_path_sluice_does_not_serve_gets_anthropics_error_and_request_id():
    """The anthropic client reads both off its 404: the shape of the error and the `request-id` header."""
    client = TestClient(create_app(ServerState(ServerSettings(ui=False))))
    answer = client.post("/v1/messages/batches", json={})
    assert answer.status_code == 404 and answer.json()["type"] == "error"
    assert answer.headers["request-id"] == answer.headers["x-request-id"]


class Replicas:
    """The replicas' handle: a call waits until `admit` is set (a replica free to take it), then its replica answers
    200 with `first`, and ends the response once `finish` is set. `calls` counts the calls made, `forwarded` holds
    their requests."""

    def __init__(self, content_type: bytes = b"text/plain", first: bytes = b"answered") -> None:
        self.admit = asyncio.Event()
        self.finish = asyncio.Event()
        self.start = ResponseStart(200, ((b"content-type", content_type),), "replica-1")
        self.first = first
        self.calls = 0
        self.forwarded: list[ForwardedRequest] = []

    def options(self, **_: Any) -> Replicas:
        return self

    def remote(self, routing: Routing, forwarded: ForwardedRequest) -> Call:
        self.calls += 1
        self.forwarded.append(forwarded)
        return Call(self)


class Call:
    """One call's stream, as a `DeploymentResponseGenerator` behaves: once `cancel()`ed, it raises what Ray Serve's
    does."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas
        self._items = [replicas.start, replicas.first]
        self._cancelled = asyncio.Event()

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        await self._first_of(self._replicas.admit if self._items else self._replicas.finish)
        if self._cancelled.is_set():
            raise RequestCancelledError("a call")
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    async def _first_of(self, event: asyncio.Event) -> None:
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._cancelled.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()

    def cancel(self) -> None:
        self._cancelled.set()


async def answer(ingress: SluiceIngress, method: str, path: str,
                 body_sent: asyncio.Event | None = None) -> tuple[int, bytes]:
    """The ingress's answer to a request with an empty body (which arrives once `body_sent` is set, if given): its
    status and body."""
    sent = await exchange(ingress, method, path, body_sent)
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:])


async def exchange(ingress: SluiceIngress, method: str, path: str, body_sent: asyncio.Event | None = None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> list[dict[str, Any]]:
    """The messages the ingress sends to answer a request with `headers` and an empty body (which arrives once
    `body_sent` is set, if given)."""
    scope = {**request(path, headers), "method": method}
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> dict[str, Any]:
        if body_sent is not None:
            await body_sent.wait()
        return next(messages, None) or await asyncio.Event().wait()  # the client stays

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await (await ingress(Request(scope, receive)))(scope, receive, send)
    return sent


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


SHUTTING_DOWN = {"message": "The server is shutting down", "type": "service_unavailable", "param": None,
                 "code": "not_ready"}


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_request_waiting_for_a_replica_when_the_drain_begins_is_served():
    """It was accepted before the drain: it is in flight, so the drain waits for it, while new requests get 503."""

    async def run() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        replicas = Replicas()
        ingress = SluiceIngress(replicas, ServerSettings())
        waiting = asyncio.ensure_future(answer(ingress, "POST", "/v1/completions"))
        await _until(lambda: replicas.calls == 1)
        drain = asyncio.ensure_future(ingress.drain(60))
        await asyncio.sleep(0)  # the drain begins
        refused = await answer(ingress, "POST", "/v1/completions")
        assert not drain.done()
        replicas.admit.set()
        replicas.finish.set()
        await asyncio.wait_for(drain, 10)
        return await waiting, refused

    served, refused = asyncio.run(run())
    assert served == (200, b"answered")
    assert refused[0] == 503 and json.loads(refused[1])["error"] == SHUTTING_DOWN


def test_a_request_still_waiting_for_a_replica_when_the_drain_times_out_gets_the_drains_503():
    """Not a hang until the application is deleted, nor a replica's failure: the 503 new requests get."""

    async def run() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        replicas = Replicas()
        ingress = SluiceIngress(replicas, ServerSettings())
        waiting = [asyncio.ensure_future(answer(ingress, "POST", path)) for path in ("/v1/completions", "/v1/messages")]
        await _until(lambda: replicas.calls == 2)
        await asyncio.wait_for(ingress.drain(0.1), 10)
        assert all(request.done() for request in waiting)  # the drain returns once they are answered
        return await waiting[0], await waiting[1]

    openai, anthropic = asyncio.run(run())
    assert openai[0] == 503 and json.loads(openai[1])["error"] == SHUTTING_DOWN
    assert anthropic[0] == 503 and json.loads(anthropic[1])["error"]["message"] == SHUTTING_DOWN["message"]


def test_a_stream_still_running_when_the_drain_times_out_ends_with_the_drains_error_event():
    """Its replica's request is cancelled too, so the replica is idle when the application is deleted."""

    async def run() -> tuple[int, bytes]:
        replicas = Replicas(b"text/event-stream", b"data: {}\n\n")
        replicas.admit.set()
        ingress = SluiceIngress(replicas, ServerSettings())
        streaming = asyncio.ensure_future(answer(ingress, "POST", "/v1/completions"))
        await _until(lambda: replicas.calls == 1)
        await asyncio.wait_for(ingress.drain(0.1), 10)
        return await asyncio.wait_for(streaming, 10)

    status, body = asyncio.run(run())
    first, error, done = body.split(b"\n\n", 2)
    assert (status, first, done) == (200, b"data: {}", b"data: [DONE]\n\n")
    assert json.loads(error.removeprefix(b"data: "))["error"] == SHUTTING_DOWN


def test_a_request_whose_body_arrives_after_the_drain_timed_out_gets_the_drains_503_without_a_replica(monkeypatch):
    """The replicas are being deleted by then: none may be called."""
    monkeypatch.setattr(ingress_module, "LAST_WORD_S", 0.1)  # the drain's wait for it, before its body arrives

    async def run() -> tuple[int, bytes]:
        replicas, body_sent = Replicas(), asyncio.Event()
        ingress = SluiceIngress(replicas, ServerSettings())
        reading = asyncio.ensure_future(answer(ingress, "POST", "/v1/completions", body_sent))
        await asyncio.sleep(0)  # its body is being read
        await ingress.drain(0.1)
        body_sent.set()
        answered = await asyncio.wait_for(reading, 10)
        assert replicas.calls == 0
        return answered

    status, body = asyncio.run(run())
    assert status == 503 and json.loads(body)["error"] == SHUTTING_DOWN


def test_every_answer_through_the_ingress_carries_the_request_id_headers_the_single_processs_would():
    """Its own answers (the drain's 503, a 413) as a replica's: `X-Request-Id` (the client's, else a fresh one,
    which the replica is given too, for its log lines), and Anthropic's `request-id` beside it on Anthropic's."""

    async def run() -> tuple[list[Headers], list[ForwardedRequest]]:
        replicas = Replicas()
        replicas.admit.set()
        replicas.finish.set()
        ingress = SluiceIngress(replicas, ServerSettings(max_body_bytes=10))
        relayed = await exchange(ingress, "POST", "/v1/completions")
        too_large = await exchange(ingress, "POST", "/v1/messages",
                                   headers=[(b"content-length", b"11"), (b"x-request-id", b"trace-1")])
        await ingress.drain(0)
        draining = await exchange(ingress, "POST", "/v1/chat/completions", headers=[(b"x-request-id", b"trace-2")])
        return [Headers(raw=sent[0]["headers"]) for sent in (relayed, too_large, draining)], replicas.forwarded

    (relayed, too_large, draining), forwarded = asyncio.run(run())
    assert len(relayed["x-request-id"]) == 32 and "request-id" not in relayed
    assert Headers(raw=list(forwarded[0].headers))["x-request-id"] == relayed["x-request-id"]
    assert too_large["x-request-id"] == too_large["request-id"] == "trace-1"
    assert draining["x-request-id"] == "trace-2" and "request-id" not in draining


def test_requests_the_drain_timeout_ends_are_logged_as_ended_by_it_not_as_a_replicas_failure(caplog):
    """One still waiting for a replica and one streaming: their replica calls fail only because the drain cancelled
    them."""

    async def run() -> None:
        waiting, streaming = Replicas(), Replicas(b"text/event-stream", b"data: {}\n\n")
        streaming.admit.set()
        for replicas, path in ((waiting, "/v1/completions"), (streaming, "/v1/chat/completions")):
            ingress = SluiceIngress(replicas, ServerSettings())
            answering = asyncio.ensure_future(answer(ingress, "POST", path))
            await _until(lambda: replicas.calls == 1)
            await asyncio.wait_for(ingress.drain(0.1), 10)
            await asyncio.wait_for(answering, 10)

    asyncio.run(run())
    logged = [record.getMessage() for record in caplog.records if record.name == "sluice.ingress"]
    assert "POST /v1/completions: ended by the drain timeout before its response started" in logged
    assert "POST /v1/chat/completions: ended by the drain timeout mid-response" in logged
    assert not any("failed" in line for line in logged)
