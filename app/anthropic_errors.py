"""Errors on Anthropic's routes in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The same `APIError`s are raised everywhere; only their rendering differs by path, so that a 401 from the API-key
middleware or a 429 from admission reaches the `anthropic` client as it would from Anthropic.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from sluice.app.anthropic_schemas import AnthropicErrorDetail, AnthropicErrorResponse
from sluice.app.errors import APIError, error_response
from sluice.app.streaming import sse_event

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: APIError) -> AnthropicErrorResponse:
    """The body of `error`; a status without its own Anthropic type is an `api_error` (5xx) or invalid request."""
    kind = _TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    details = {"error_code": error.code} if error.code is not None else None
    return AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=error.message, details=details))


def anthropic_error_event(error: APIError) -> bytes:
    """`error` as the `error` event that ends an Anthropic stream."""
    return b"event: error\n" + sse_event(anthropic_error(error).model_dump(exclude_none=True))


def error_response_for(path: str, error: APIError) -> JSONResponse:
    """`error` as the route at `path` speaks: Anthropic's shape on its routes, OpenAI's elsewhere."""
    if path not in ANTHROPIC_PATHS:
        return error_response(error)
    return JSONResponse(anthropic_error(error).model_dump(exclude_none=True), status_code=error.status,
                        headers=error.headers)
