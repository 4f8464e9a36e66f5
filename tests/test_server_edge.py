"""The server's edge: what the request counts and the dashboard's error list say about requests that got no answer
(under a real uvicorn, no model loaded) or whose answer failed (the tiny model's engine), bodies that stop arriving,
and the scale-out ingress's reading of bodies."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from prometheus_client import CollectorRegistry, generate_latest
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import ASGIApp

from sluice.app.ingress import SluiceIngress, _ReplicaReports, routing
from sluice.app.prefix_router import Routing
from sluice.app.metrics import ServerMetrics
from sluice.app import anthropic_responses, middleware
from sluice.app.middleware import BodyReadMiddleware, InternalErrorMiddleware, RequestCountMiddleware
from sluice.app.replicas import ReplicaReport
from sluice.app.serve import DrainingServer
from sluice.app.server import create_app
from sluice.app.streaming import EventStreamResponse
from sluice.app.state import ServerSettings, ServerState
from sluice.bench.prefix_cache import CacheCounters, parse

from test_server_engine import COMPLETION, engine, serve  # noqa: F401 - engine: the fixture
from test_stalled_readers import read_to_end


@contextmanager
def serving(app: ASGIApp) -> Iterator[tuple[uvicorn.Server, tuple[str, int]]]:
    """`app` under a real uvicorn, run in a thread, and its address."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield server, server.servers[0].sockets[0].getsockname()[:2]
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def served() -> Iterator[tuple[ServerState, tuple[str, int]]]:
    """A loading server's state and its address."""
    state = ServerState(ServerSettings())
    with serving(create_app(state)) as (_, address):
        yield state, address


def wait_until(done: Callable[[], bool], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        time.sleep(0.05)


def counts(address: tuple[str, int], route: str) -> list[str]:
    """The `sluice_requests_total` samples of `route`."""
    text = httpx.get("http://{}:{}/metrics".format(*address)).text
    return [line for line in text.splitlines() if line.startswith(f'sluice_requests_total{{route="{route}",')]


def test_a_client_gone_while_sending_its_body_is_counted_as_closed_not_as_a_server_error(served):
    state, address = served
    with socket.create_connection(address) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: sluice\r\nContent-Length: 100\r\n\r\n{\"prompt")
        time.sleep(0.1)  # the middleware is waiting for the rest of the body when the client leaves
    wait_until(lambda: counts(address, "/v1/completions"))
    assert counts(address, "/v1/completions") == ['sluice_requests_total{route="/v1/completions",status="499"} 1.0']
    [error] = state.metrics.recent.take().errors
    assert (error.kind, error.status, error.message) == ("aborted", 499, "The client left before it was answered")


STALLED = "The request body stopped arriving: nothing came for 0.5 s"


@pytest.mark.parametrize(("path", "error"), [
    ("/v1/completions", {"error": {"message": STALLED, "type": "invalid_request_error", "param": None,
                                   "code": "body_stalled"}}),
    ("/v1/messages", {"type": "error", "error": {"type": "invalid_request_error", "message": STALLED,
                                                 "details": {"error_code": "body_stalled"}}}),
], ids=["openai", "anthropic"])
def test_a_body_that_stops_arriving_is_a_408_in_its_apis_shape_and_its_connection_closes(monkeypatch, path, error):
    """nginx's client_body_timeout: uvicorn has none, so the connection and the handler's task waited for ever."""
    monkeypatch.setattr(middleware, "BODY_STALL_TIMEOUT_S", 0.5)
    state = ServerState(ServerSettings())
    with serving(create_app(state)) as (server, address), socket.create_connection(address) as client:
        client.sendall(f"POST {path} HTTP/1.1\r\nHost: sluice\r\nContent-Length: 1000\r\n\r\n".encode() + b"x" * 10)
        head, _, body = read_to_end(client, timeout_s=5).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body) == error
        wait_until(lambda: not server.server_state.tasks and not server.server_state.connections)
        assert counts(address, path) == [f'sluice_requests_total{{route="{path}",status="408"}} 1.0']
        assert asyncio.run(state.wait_idle(1))  # nothing admitted: a drain would not wait for it


def test_a_drain_given_no_time_ends_a_server_whose_model_is_still_loading():
    """`--drain-timeout 0` and a SIGTERM while the model loads: nothing is in flight, so there is nothing to abort
    (and no engine to abort it in), and the server exits."""
    state = ServerState(ServerSettings())
    server = DrainingServer(uvicorn.Config(create_app(state)), state, drain_timeout_s=0)
    asyncio.run(server._drain())
    assert server.should_exit


def test_the_replicas_ingress_answers_a_body_that_stops_arriving_with_a_408_no_replica_sees(monkeypatch):
    """`sluice serve --replicas`: the ingress reads each body before any replica is chosen, through the same
    reader, so a stalled body is a 408 there too (it waited for ever)."""
    monkeypatch.setattr(middleware, "BODY_STALL_TIMEOUT_S", 0.2)

    class NoReplicas:  # the replicas' handle: none may be called
        def options(self, **_):
            return self

        def remote(self, *_):
            raise AssertionError("a replica was called")

    parts = iter([{"type": "http.request", "body": b"x" * 10, "more_body": True}])

    async def receive():
        return next(parts, None) or await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-length", b"1000")]}
    sent = []

    async def send(message):
        sent.append(message)

    async def answer():
        response = await SluiceIngress(NoReplicas(), ServerSettings(max_body_bytes=1 << 20))(Request(scope, receive))
        await response(scope, receive, send)

    asyncio.run(answer())
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    assert sent[0]["status"] == 408 and json.loads(body)["error"]["code"] == "body_stalled"


def test_a_slow_body_that_keeps_arriving_is_read_whole(monkeypatch):
    monkeypatch.setattr(middleware, "BODY_STALL_TIMEOUT_S", 1.0)

    async def length(request: Request) -> Response:
        return PlainTextResponse(str(len(await request.body())))

    app = Starlette(routes=[Route("/length", length, methods=["POST"])],
                    middleware=[Middleware(BodyReadMiddleware, max_bytes=1000)])
    with serving(app) as (_, address), socket.create_connection(address) as client:
        client.sendall(b"POST /length HTTP/1.1\r\nHost: sluice\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n")
        for _ in range(10):  # 2 s in all, twice the limit, but never a second without a byte
            time.sleep(0.2)
            client.sendall(b"x" * 100)
        head, _, body = read_to_end(client, timeout_s=5).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"1000"


def test_a_stream_whose_reader_stops_as_its_last_event_goes_out_still_ends_at_the_stall_limit():
    """The server waits for a full socket to drain before any send, the empty last body included: a last event
    that fills the socket (a Responses stream's holds the whole response) blocks that send, which ends the stream
    at the stall limit as a blocked event does, and its request is closed (its admission released)."""
    ended: list[str] = []
    full = asyncio.Event()

    async def events():
        yield b"data: 1\n\n"
        full.set()  # this event fills the socket; from now on, every send waits for a reader that never reads

    async def send(message) -> None:
        if full.is_set():
            await asyncio.Event().wait()

    async def receive():
        await asyncio.Event().wait()  # the client stays connected

    async def on_close() -> None:
        ended.append("closed")

    async def scenario() -> None:
        response = EventStreamResponse(events(), on_close=on_close, keepalive_s=0.05, stall_timeout_s=0.2,
                                       on_stall=lambda: ended.append("stalled"))
        await asyncio.wait_for(response({"type": "http"}, receive, send), 10)

    asyncio.run(scenario())
    assert ended == ["stalled", "closed"]


class EndlessFeed:
    """The dashboard's feed (which needs an engine) stood in for: large events as fast as the stream takes them, so
    that a reader's window fills at once."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    async def events(self):
        try:
            while True:
                yield b"data: " + b"x" * 65536 + b"\n\n"
        finally:
            self.closed.set()


def test_a_dashboard_whose_reader_stops_is_ended_at_the_stall_limit():
    """A tab that stops reading (a suspended laptop) held its stream's task and connection for ever."""
    state = ServerState(ServerSettings(stream_stall_timeout_s=0.5, sse_keepalive_s=0.1))
    app = create_app(state)
    app.state.feed = feed = EndlessFeed()
    with serving(app) as (server, address), socket.socket() as reader:
        # Before connect: a small window, and small segments, so the server's sends fill it.
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        reader.connect(address)
        reader.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: sluice\r\n\r\n")  # and never reads
        assert feed.closed.wait(10)
        wait_until(lambda: not server.server_state.tasks)


def test_a_route_that_raises_is_answered_with_its_apis_500_and_counted():
    """Answered inside the app, so the exception does not reach the server, which would close the connection."""
    async def broken(request: Request) -> None:
        raise RuntimeError("a bug")

    metrics = ServerMetrics(lambda: None)
    routes = (Route("/broken", broken), Route("/v1/messages", broken, methods=["POST"]))
    counting = Middleware(RequestCountMiddleware, metrics=metrics, routes=routes)
    app = Starlette(routes=list(routes), middleware=[Middleware(InternalErrorMiddleware), counting])
    client = TestClient(app)  # raises what reaches the server
    response = client.get("/broken")
    assert response.status_code == 500 and response.json()["error"]["message"] == "Internal server error"
    assert client.post("/v1/messages").json() == {"type": "error", "error": {"type": "api_error",
                                                                         "message": "Internal server error"}}
    metrics.recent.take()
    assert client.get("/broken").status_code == 500
    assert 'sluice_requests_total{route="/broken",status="500"} 2.0' in metrics.render().decode()
    [error] = metrics.recent.take().errors
    assert (error.status, error.message) == (500, "RuntimeError: a bug")  # the dashboard's list names it


def fail_naming_tokens(engine, monkeypatch) -> None:
    """A tokenizer fault in building responses: logprobs name their tokens by `token_text`, which the engine never
    calls."""
    def failing(token_id: int) -> str:
        raise RuntimeError("injected tokenizer fault")

    monkeypatch.setattr(engine.tokenizer, "token_text", failing)


def test_a_stream_whose_building_fails_is_counted_as_the_servers_error_not_the_clients_leaving(engine, monkeypatch):
    """The builder tells the client (a 500 error event), but the stream was listed as one whose client left (499)
    and its latency as an abort: a bug in shaping responses showed on the dashboard as clients hanging up."""
    fail_naming_tokens(engine, monkeypatch)

    async def scenario(client, state):
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True, "logprobs": 1})
        return response, state.metrics.recent.take().errors, state.metrics.render().decode()

    response, (error,), metrics = serve(engine, scenario)
    events = [e[len("data: "):] for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert (error.kind, error.status) == ("5xx", 500) and error.source.startswith("cmpl-")
    assert 'sluice_e2e_request_latency_seconds_count{outcome="error"} 1.0' in metrics
    assert 'outcome="abort"' not in metrics


def test_a_whole_response_whose_building_fails_is_a_500_counted_as_an_error_not_an_abort(engine, monkeypatch):
    """Its latency was counted under the outcome of a request whose client left."""
    fail_naming_tokens(engine, monkeypatch)

    async def scenario(client, state):
        response = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 1})
        return response, state.metrics.render().decode()

    response, metrics = serve(engine, scenario)
    assert response.status_code == 500 and response.json()["error"]["message"] == "Internal server error"
    assert 'sluice_e2e_request_latency_seconds_count{outcome="error"} 1.0' in metrics
    assert 'outcome="abort"' not in metrics


def test_a_message_stream_whose_opening_fails_ends_in_an_anthropic_error_event(engine, monkeypatch):
    """`message_start` was built outside the stream's error handling: a bug there cut the body short with no error
    event (uvicorn's "Exception in ASGI application")."""
    def failing(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(anthropic_responses.MessageBuilder, "_message", failing)

    async def scenario(client, state):
        response = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "stream": True,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
        return response, state.metrics.render().decode()

    response, metrics = serve(engine, scenario)
    (event,) = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert event == {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}
    assert 'sluice_e2e_request_latency_seconds_count{outcome="error"} 1.0' in metrics


def test_a_body_nested_too_deep_for_the_json_parser_has_no_routing_key():
    assert routing("/v1/completions", b"[" * 100_000) == Routing("")


@pytest.mark.parametrize(("path", "body", "replica"), [
    ("/v1/responses/resp_r7x2_0a1b", b"", "r7x2"),
    ("/v1/responses/resp_r7x2_0a1b/input_items", b"", "r7x2"),
    ("/v1/responses", b'{"input": "Hi", "previous_response_id": "resp_r7x2_0a1b"}', "r7x2"),
    ("/v1/responses", b'{"input": "Hi"}', None),
    ("/v1/responses/resp_0a1b", b"", None),  # a single process's id names no replica
    ("/v1/responses", b'{"input": "Hi", "previous_response_id": 7}', None),  # the replica answers its 400
    ("/v1/chat/completions", b'{"previous_response_id": "resp_r7x2_0a1b"}', None),
    # A stored item's id names the replica too, by reference or bare (`{"id": ...}`).
    ("/v1/responses", b'{"input": [{"type": "item_reference", "id": "msg_r7x2_0a1b"}, {"role": "user", "content": '
                      b'"And?"}]}', "r7x2"),
    ("/v1/responses", b'{"input": [{"role": "user", "content": "Hi"}, {"id": "fc_r7x2_0a1b"}]}', "r7x2"),
    ("/v1/responses", b'{"input": [{"id": "msg_r1_0a1b"}], "previous_response_id": "resp_r7x2_0a1b"}', "r7x2"),
    ("/v1/responses/input_tokens", b'{"input": "Hi", "previous_response_id": "resp_r7x2_0a1b"}', "r7x2"),
    # A conversation's id too, in the path or as a Responses request's `conversation`.
    ("/v1/conversations/conv_r7x2_0a1b", b"", "r7x2"),
    ("/v1/conversations/conv_r7x2_0a1b/items/msg_r1_0a1b", b"", "r7x2"),
    ("/v1/responses", b'{"input": "Hi", "conversation": "conv_r7x2_0a1b"}', "r7x2"),
    ("/v1/responses", b'{"input": "Hi", "conversation": {"id": "conv_r7x2_0a1b"}}', "r7x2"),
    ("/v1/responses/input_tokens", b'{"input": "Hi", "conversation": {"id": "conv_r7x2_0a1b"}}', "r7x2"),
    ("/v1/conversations", b'{"items": []}', None),  # a new conversation: any replica
])
def test_a_request_naming_a_stored_response_or_conversation_is_routed_to_the_replica_that_stores_it(path, body, replica):
    assert routing(path, body).replica == replica


def exported(reports: _ReplicaReports) -> dict[str, CacheCounters]:
    registry = CollectorRegistry()
    registry.register(reports)
    return parse(generate_latest(registry).decode())


def test_the_ingress_exports_each_replicas_latest_counters_under_the_single_process_names():
    reports = _ReplicaReports(lambda: {"a", "b"})
    for report in (ReplicaReport("a", 0, 16), ReplicaReport("b", 0, 8), ReplicaReport("a", 192, 400)):
        reports.record(report)
    assert exported(reports) == {"a": CacheCounters(192, 400), "b": CacheCounters(0, 8)}


def test_the_ingress_drops_a_replicas_counters_once_it_is_no_longer_running():
    running = {"a", "b"}
    reports = _ReplicaReports(lambda: running)
    reports.record(ReplicaReport("a", 0, 16))
    reports.record(ReplicaReport("b", 0, 8))
    running.discard("a")  # scaled down, or dead
    assert exported(reports) == {"b": CacheCounters(0, 8)}
    reports.record(ReplicaReport("a", 64, 80))  # a response it finished while draining
    assert exported(reports) == {"b": CacheCounters(0, 8)}


def test_the_ingress_keeps_every_report_while_the_running_replicas_are_not_known():
    reports = _ReplicaReports(lambda: None)
    reports.record(ReplicaReport("a", 0, 16))
    assert exported(reports) == {"a": CacheCounters(0, 16)}


def test_the_routing_key_starts_with_the_prefix_caches_namespace_the_model_or_adapter_and_the_salt():
    """Two requests of one prompt share a replica's cached pages only under the same model (or LoRA adapter) and
    cache_salt: their keys share a prefix only then."""
    def key(**fields) -> str:
        return routing("/v1/completions", json.dumps({"prompt": "A long shared system prompt", **fields}).encode()).key

    base, adapter, salted = key(model="tiny"), key(model="sql-lora"), key(model="tiny", cache_salt="tenant")
    assert base == key(model="tiny", max_tokens=8)
    assert len({k[:64] for k in (base, adapter, salted)}) == 3  # no first block in common (the router's 64 chars)
