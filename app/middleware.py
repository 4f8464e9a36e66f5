"""ASGI middleware that acts before routing: request ids, a bug's 500, API-key check, body reading (size and stall
limits), per-route request counts."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.app.anthropic_errors import error_response_for, is_anthropic
from sluice.app.errors import APIError, body_stalled, body_too_large, internal_error, unauthorized
from sluice.app.metrics import ServerMetrics
from sluice.app.openapi import path_template

logger = logging.getLogger(__name__)

# Probes, scrapers and API explorers do not hold the API key (nor does a browser opening the dashboard page).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json"})

# How long a request body may stop arriving: nginx's client_body_timeout, and --stream-stall-timeout's default
# for a reader that stops taking a stream.
BODY_STALL_TIMEOUT_S = 60.0


# A client's own X-Request-Id is echoed when it is a plain token of this length at most (vLLM echoes any).
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class RequestIdMiddleware:
    """Every answer carries `X-Request-Id` (the client's, as a proxy or vLLM passes it on, else a fresh one), where
    the openai client reads `_request_id`; Anthropic's requests carry it as `request-id` too, the anthropic
    client's. The request carries that id on from here (its `X-Request-Id` header): the replicas' ingress forwards
    it, so that a replica answers, and logs, under the id the ingress answers with."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id  # for the server's log lines about it
        MutableHeaders(scope=scope)["x-request-id"] = request_id
        names = ("x-request-id", "request-id") if is_anthropic(scope) else ("x-request-id",)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name in names:
                    headers[name] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class InternalErrorMiddleware:
    """Outermost but for CORS (whose headers the 500 then carries): a request whose handler raised (a bug) before
    its response started gets its route's 500, and the exception is logged. Starlette's own handler re-raises after
    answering, and the server then closes the connection, so a client's next request on it failed too. A failure
    after the response started still propagates: that response cannot be mended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception:
            if started:
                raise
            logger.exception("unhandled error on %s (request id %s)", scope["path"],
                             scope.get("state", {}).get("request_id"))
            await error_response_for(scope, internal_error())(scope, receive, send)


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header) matches, compared in
    constant time, on all but `open_paths`."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths:
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            keys = [token.strip() if scheme.lower() == "bearer" else None, headers.get("x-api-key")]
            # Starlette decodes header bytes as latin-1: encoded back, they are the bytes the client sent.
            if not any(key is not None and hmac.compare_digest(key.encode("latin-1"), self._key) for key in keys):
                await error_response_for(scope, unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyReadMiddleware:
    """Reads the body whole before the app runs (bodies here are small JSON), then replays it; later `receive`
    calls go to the server, so the app can still see `http.disconnect`.

    A body over `max_bytes`, whether declared by Content-Length or only found while reading, is a 413. A body
    that stops arriving (nothing for `BODY_STALL_TIMEOUT_S` while some is still due) is a 408, as nginx's
    client_body_timeout answers: the server has no timeout of its own for it, and the connection and this task
    would wait for ever.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            whole = await read_body(scope, receive, self._max_bytes)
        except APIError as error:
            await error_response_for(scope, error)(scope, receive, send)
            return
        if whole is None:
            return
        body: Message | None = {"type": "http.request", "body": whole, "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)


async def read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The request's whole body; None if the client left first. APIError: 413 past `max_bytes` (declared or
    read), 408 when nothing arrives for `BODY_STALL_TIMEOUT_S` while some is still due."""
    declared = Headers(scope=scope).get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(BODY_STALL_TIMEOUT_S):
                message = await receive()
        except TimeoutError:
            raise body_stalled(BODY_STALL_TIMEOUT_S) from None
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            raise body_too_large(max_bytes)
        if not message.get("more_body", False):
            return b"".join(chunks)


# nginx's status for a client that closed its connection before the answer (streaming.py answers it too).
CLIENT_CLOSED = 499


class RequestCountMiddleware:
    """Counts responses by route (its path template, such as /v1/responses/{response_id}; unknown paths share
    the label "other") and status code, and hands error responses' messages to the dashboard's error list.

    A request that got no response counts as a 500 if the app raised (the server then sends that 500), else
    as a 499: its client left before there was anything to answer (while still sending its body, say).
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: tuple[Route, ...]) -> None:
        self.app = app
        self._metrics = metrics
        self._routes = {path_template(route.path): route.path_regex for route in routes}

    def _route(self, path: str) -> str:
        if path in self._routes:
            return path
        return next((template for template, regex in self._routes.items() if regex.match(path)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0  # until the response starts
        error_body = b""

        async def send_recording_status(message: Message) -> None:
            nonlocal status, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400:
                error_body += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        except Exception as error:
            # The 500 is sent outside this middleware (`InternalErrorMiddleware`): its list entry names the
            # exception instead.
            status, error_body = status or 500, error_body or f"{type(error).__name__}: {error}".encode()
            raise
        finally:
            if not status:
                status, error_body = CLIENT_CLOSED, b"The client left before it was answered"
            message = _error_message(error_body) if status >= 400 else None
            self._metrics.responded(self._route(scope["path"]), status, message)


def _error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body as text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")
