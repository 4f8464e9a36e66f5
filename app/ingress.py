"""The HTTP ingress of `sluice serve --replicas N`: every request to a Sluice replica, streamed back as it comes.

Why an ingress deployment in front of the replicas rather than the replicas as Ray Serve's HTTP ingress: the
proxy routes an HTTP request before its body is read, so a router there cannot see the prompt; and when a
replica dies mid-stream, something outside it must end the client's stream cleanly. So the ingress reads the
body, derives its `routing` (the routing key: the request's prompt fields, as JSON; and the replica that stores a
response it names) and calls the replicas' handle, whose router (`app/prefix_router.py`) picks the replica; the replica runs the request through the
single process's app (`app/replicas.py`) and the ingress relays the status, headers and body bytes unchanged,
adding `x-sluice-replica` (which replica answered).

The ingress applies the server's CORS policy (`--allowed-origins` etc.) to everything it answers, as the single
process's outermost middleware does: it answers a browser's preflight itself, and its own errors (413, 408, 503)
carry the CORS headers too, so a page can read why its request failed. They carry the request id too, as the
single process's answers do (`X-Request-Id`, and `request-id` on Anthropic's): the one the replica is given.

A replica that fails before it answered gives the client a 503 in the route's error shape; one that dies
mid-stream ends an event stream with an error event (then `data: [DONE]`, as a failed generation does in the
single process; Anthropic's routes get their `event: error`), and cuts any other body short, so no client is
left waiting. `GET /metrics` here reports the running replicas' prefix-cache counters, labelled by replica, as of
the last response each sent through this ingress (a replica scaled down or dead is dropped); a replica's own
/metrics is not reachable. `/health` (and `/ping`) is answered here too, at once: 200 while a replica runs, 503
while none does (loading) or once draining.

`drain` (called by `app/ray_app.py` on SIGTERM, before it deletes the application) makes the ingress answer new
requests 503 as the single process does while draining, and waits for the requests in flight here to end, those
still waiting for a replica included; after `--drain-timeout` it ends the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.app.anthropic_errors import anthropic_error_event, error_response_for, is_anthropic
from sluice.app.errors import APIError, shutting_down
from sluice.app.middleware import CLIENT_CLOSED, InternalErrorMiddleware, RequestIdMiddleware, read_body
from sluice.app.prefix_router import Routing
from sluice.app.replicas import ForwardedRequest, ReplicaReport, ResponseStart
from sluice.app.response_ids import replica_of
from sluice.app.responses_api_schemas import item_type
from sluice.app.scale_out import REPLICA_HEADER
from sluice.app.server import ROUTES, health, health_response
from sluice.app.state import ServerSettings, unready_reason, wait_set
from sluice.app.streaming import DONE, sse_event

logger = logging.getLogger("sluice.ingress")

# The body fields that hold a prompt, in the order a prompt's text comes (instructions and system prompts first).
PROMPT_FIELDS = ("instructions", "system", "messages", "input", "prompt")
STATE_PATHS = ("/v1/responses/", "/v1/conversations/")  # then a stored response's or conversation's id
# The Responses routes whose body may name stored state (an earlier response, a conversation, an item).
RESPONSES_BODY_PATHS = frozenset(("/v1/responses", "/v1/responses/input_tokens"))
# How long the drain, once its time is up, gives the requests it ends to send their last words (a 503, an error event).
LAST_WORD_S = 5.0
# The single process's /health and its other names, as (path, method): the ingress answers them itself.
HEALTH_ROUTES = frozenset((operation.path, operation.method) for handler, operation in ROUTES if handler is health)


def routing(path: str, body: bytes) -> Routing:
    """The request's routing key, and the replica it must go to where it names a stored response, conversation or
    item: by its path (`/v1/responses/{id}`, `.../input_items`, `/v1/conversations/{id}`, `.../items`), its
    `previous_response_id` or `conversation`, or else its input's first item reference."""
    payload = _json_object(body)
    named = next((path.removeprefix(prefix).split("/")[0] for prefix in STATE_PATHS if path.startswith(prefix)), None)
    if path in RESPONSES_BODY_PATHS:
        named = (payload.get("previous_response_id") or _conversation_id(payload.get("conversation"))
                 or _first_reference(payload.get("input")))
    return Routing(routing_key(payload), replica_of(named) if isinstance(named, str) else None)


def _conversation_id(conversation: Any) -> Any:
    """The id a Responses request's `conversation` names (a string, or `{"id": ...}`)."""
    return conversation.get("id") if isinstance(conversation, dict) else conversation


def _first_reference(items: Any) -> Any:
    """The id of the first item reference among a Responses request's input `items`, if any."""
    if not isinstance(items, list):  # a string (one user message), or a shape the replica refuses
        return None
    return next((item.get("id") for item in items if isinstance(item, dict) and item_type(item) == "item_reference"),
                None)


def routing_key(payload: dict[str, Any]) -> str:
    """The text whose prefixes choose the replica: the JSON of the body's `model` and `cache_salt`, then its prompt
    fields, in `PROMPT_FIELDS` order.

    Requests that share a system prompt, a conversation's earlier turns or the first token ids of a prompt share
    a prefix of their keys, if they also share the prefix cache's namespace: the model or LoRA adapter they name,
    and their salt. A body without prompt fields has no key.
    """
    prompt = [payload[field] for field in PROMPT_FIELDS if field in payload]
    namespace = [payload.get("model"), payload.get("cache_salt")]
    return json.dumps(namespace + prompt, separators=(",", ":")) if prompt else ""


def _json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object; {} for one that is not an object (the replica answers its 400), or nested deeper than
    the parser recurses (a body of 100 KB can be)."""
    try:
        payload = json.loads(body) if body else {}
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return {}
    return payload if isinstance(payload, dict) else {}


class SluiceIngress:
    """A Ray Serve deployment class; `replicas` is the handle of the `SluiceReplica` deployment, `settings` the
    server's (its body limit and CORS policy are the ingress's)."""

    def __init__(self, replicas: DeploymentHandle, settings: ServerSettings) -> None:
        self._replicas = replicas.options(method_name="forward", stream=True)
        self._max_body_bytes = settings.max_body_bytes
        self._reports = _ReplicaReports(lambda: _running_replicas(self._replicas))
        self._registry = CollectorRegistry()
        self._registry.register(self._reports)
        self._draining = False
        self._time_up = False  # the drain's timeout has passed: no request reaches a replica any more
        self._calls: weakref.WeakSet[DeploymentResponseGenerator] = weakref.WeakSet()  # the replica calls not over
        self._in_flight = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        # As the single process's app stacks them: CORS outermost, so a bug's 500 carries its headers too, and the
        # request id on every answer, the ingress's own as its replicas'.
        self._app = CORSMiddleware(RequestIdMiddleware(InternalErrorMiddleware(self._serve)), **settings.cors_options())

    async def __call__(self, request: Request) -> Response:
        return _ASGIResponse(self._app)

    async def drain(self, timeout_s: float) -> None:
        """Answers new requests 503 from now on, as the single process does once draining, and returns once the
        requests in flight here have ended: those already here, waiting for a replica or answered by one, are served.

        After `timeout_s` the drain ends what is left: a request still waiting for a replica is answered that same
        503, and a response still coming is cut short (an event stream with that error as its last event). Its
        replica's request is cancelled, so the replicas are idle when the application is deleted: Ray Serve then
        stops them at once, instead of waiting for them (`--drain-timeout` again) before cutting the streams."""
        self._draining = True
        if await wait_set(self._idle, timeout_s):
            return
        logger.warning("%d requests still in flight after the drain timeout: ending them", self._in_flight)
        self._time_up = True
        for call in list(self._calls):
            call.cancel()
        await wait_set(self._idle, LAST_WORD_S)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._in_flight += 1
        self._idle.clear()
        try:
            response = await self._answer(Request(scope, receive))
            await response(scope, receive, send)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _answer(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)
        if (path, request.method) in HEALTH_ROUTES:
            return self._health()
        if self._draining:
            return error_response_for(request.scope, shutting_down())
        try:
            body = await read_body(request.scope, request.receive, self._max_body_bytes)
        except APIError as error:  # 413, or 408 for a body that stopped arriving: no replica sees it
            return error_response_for(request.scope, error)
        if body is None:  # the client left
            return Response(status_code=CLIENT_CLOSED)
        if self._time_up:
            return error_response_for(request.scope, shutting_down())
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     tuple(request.scope["headers"]), body)
        stream: DeploymentResponseGenerator = self._replicas.remote(routing(path, body), forwarded)
        self._calls.add(stream)
        try:
            start = await anext(stream)
        except Exception as error:  # the replica died or failed before answering, or the drain ended the wait
            stream.cancel()
            failure = self._call_failed(request.scope, "before its response started", error)
            return error_response_for(request.scope, failure)
        assert isinstance(start, ResponseStart)
        headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in start.headers)
        headers[REPLICA_HEADER] = start.replica
        return StreamingResponse(self._relay(stream, request.scope, _is_event_stream(start)), status_code=start.status,
                                 headers=headers)

    def _health(self) -> Response:
        """The single process's /health: 200 while a replica runs (one loading is not running yet), else 503."""
        return health_response(unready_reason(self._draining, bool(_running_replicas(self._replicas))))

    async def _relay(self, stream: DeploymentResponseGenerator, scope: Scope, events: bool) -> AsyncIterator[bytes]:
        try:
            async for item in stream:
                if isinstance(item, ReplicaReport):
                    self._reports.record(item)
                else:
                    yield item
        except Exception as error:
            failure = self._call_failed(scope, "mid-response", error)
            if events:
                yield _stream_failure(scope, failure)

    def _call_failed(self, scope: Scope, when: str, error: Exception) -> APIError:
        """What the client of `scope`, whose replica call failed `when` with `error`, is told, and the log line: once
        the drain's time is up, that the drain ended it (it cancelled the call), else that its replica failed."""
        request = f"{scope['method']} {scope['path']}"
        if self._time_up:
            logger.warning("%s: ended by the drain timeout %s", request, when)
            return shutting_down()
        logger.warning("%s: the replica failed %s: %s", request, when, error)
        return _replica_failed()


class _ASGIResponse(Response):
    """`app` answering the request, as the Response an HTTP handler returns: Ray Serve sends that Response by
    calling it with the request's scope, receive and send. (`serve.ingress` makes a deployment an ASGI app, but one
    built without the deployment's arguments: the replicas' handle.)"""

    def __init__(self, app: ASGIApp) -> None:  # no status, headers nor body of its own: `app` sends them
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _running_replicas(handle: DeploymentHandle) -> set[str] | None:
    """The unique ids of the replicas `handle` routes to now (Ray Serve's controller updates them as replicas start,
    stop or die), or None before its request router has them. Ray Serve names them nowhere public (`serve.status()`
    only counts them), so they are read from the handle's router."""
    try:
        router = handle._router._asyncio_router._request_router
    except AttributeError:  # a Ray Serve that keeps them elsewhere: no replica is known to be gone
        return None
    return None if router is None else {replica_id.unique_id for replica_id in list(router.curr_replicas)}


class _ReplicaReports:
    """A Prometheus collector of each running replica's prefix-cache counters, as of the last response it sent
    here. `running`: the running replicas' ids, or None while not known; the report of a replica gone (scaled down,
    or dead: its last report would be exported forever, and one kept per replica ever started) is dropped."""

    def __init__(self, running: Callable[[], set[str] | None]) -> None:
        self._running = running
        self._latest: dict[str, ReplicaReport] = {}

    def record(self, report: ReplicaReport) -> None:
        self._latest[report.replica] = report
        self._drop_gone()

    def _drop_gone(self) -> None:
        running = self._running()
        if running is not None:
            self._latest = {replica: report for replica, report in self._latest.items() if replica in running}

    def collect(self) -> Iterator[CounterMetricFamily]:
        self._drop_gone()
        for name, field, help in (
            ("sluice_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "prompt tokens served from the cache"),
            ("sluice_prefix_cache_query_tokens", "prefix_cache_query_tokens", "prompt tokens looked up"),
        ):
            family = CounterMetricFamily(name, f"Each replica's {help}, as of its last response.", labels=["replica"])
            for report in self._latest.values():
                family.add_metric([report.replica], getattr(report, field))
            yield family


def _replica_failed() -> APIError:
    return APIError(503, "The replica serving this request failed; retry", type="server_error",
                    code="replica_failed")


def _stream_failure(scope: Scope, error: APIError) -> bytes:
    """How the event stream answering `scope` ends when its replica call failed with `error`: the request's error
    event (and `[DONE]`)."""
    if is_anthropic(scope):
        return anthropic_error_event(error)
    return sse_event(error.body()) + DONE


def _is_event_stream(start: ResponseStart) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
