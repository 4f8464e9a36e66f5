"""Errors to Anthropic's requests in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The same `APIError`s are raised everywhere; only their rendering differs by request, so that a 401 from the API-key
middleware or a full queue at admission reaches the `anthropic` client as it would from Anthropic. A request is
Anthropic's on the Messages API's paths, and on any other (the paths both APIs share: `/v1/models/{id}`) when it
carries `anthropic-version`, which the `anthropic` client sends on every request. Errors must be told apart so: the
two shapes cannot be one body (each has its own `error.type`), as the model list's and card's are.

A full waiting queue is the server's overload, not the caller's rate limit: Anthropic answers an overload with 529
`overloaded_error` (the client's `OverloadedError`, retried, after `Retry-After` when sent), keeping 429
`rate_limit_error` (`RateLimitError`) for an account over its own limits, which Sluice has none of. So the queue's
429 is a 529 here (its `Retry-After` kept), and stays a 429 on the OpenAI routes. Sluice's 503s (loading, draining,
a request aborted, a replica lost) keep their status, which proxies and load balancers read (the client raises
`ServiceUnavailableError` and retries), as `api_error`: Anthropic pairs `overloaded_error` with 529 alone.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Scope

from sluice.app.anthropic_schemas import AnthropicErrorDetail, AnthropicErrorResponse
from sluice.app.errors import APIError, error_response
from sluice.app.streaming import sse_event

MESSAGES_PATH = "/v1/messages"  # the Messages API: this path and those under it
ANTHROPIC_VERSION = "anthropic-version"  # the header an `anthropic` client sends on every request

OVERLOADED = 529  # Anthropic's status for an overloaded API (no standard HTTP status says it)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


def _status(error: APIError) -> int:
    """The status `error` has on Anthropic's routes: a full queue is an overload (529), the rest their own."""
    return OVERLOADED if error.code == "queue_full" else error.status


def anthropic_error(error: APIError) -> AnthropicErrorResponse:
    """The body of `error`; a status without its own Anthropic type is an `api_error` (5xx) or invalid request."""
    status = _status(error)
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    details = {"error_code": error.code} if error.code is not None else None
    return AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=error.message, details=details))


def anthropic_error_event(error: APIError) -> bytes:
    """`error` as the `error` event that ends an Anthropic stream."""
    return b"event: error\n" + sse_event(anthropic_error(error).model_dump(exclude_none=True))


def is_anthropic(scope: Scope) -> bool:
    """Whether the request is Anthropic's, whose answers are Anthropic's (error shape, `request-id` header): on the
    Messages API's paths (its routes Sluice does not serve, `/v1/messages/batches`, answered 404, too), or from an
    `anthropic` client anywhere (`anthropic-version`)."""
    path = scope["path"]
    return (path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")
            or ANTHROPIC_VERSION in Headers(scope=scope))


def error_response_for(scope: Scope, error: APIError) -> JSONResponse:
    """`error` as the request in `scope` expects it: in Anthropic's shape if it is Anthropic's, else OpenAI's."""
    if not is_anthropic(scope):
        return error_response(error)
    return JSONResponse(anthropic_error(error).model_dump(exclude_none=True), status_code=_status(error),
                        headers=error.headers)
