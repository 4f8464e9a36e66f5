"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with a matching status."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client sees; raised anywhere below a route and rendered by `error_response`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(error: ValidationError) -> APIError:
    """The first pydantic complaint, with its field path (`messages.0.role`) as `param`."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return invalid_request(message, param)


def internal_error() -> APIError:
    return APIError(500, "Internal server error", type="server_error")


def as_api_error(error: Exception, where: str) -> APIError:
    """`error` as the client is told it: itself if an `APIError`, else a 500 (a bug, logged with its traceback):
    a stream that fails after its 200 still ends with its API's error event."""
    if isinstance(error, APIError):
        return error
    logger.error("unhandled error in %s", where, exc_info=error)
    return internal_error()


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Missing or incorrect API key", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes", code="request_too_large")


def body_stalled(timeout_s: float) -> APIError:
    """The answer to a body that stopped arriving; the connection is closed after it, as the rest of the body
    may still come."""
    return APIError(408, f"The request body stopped arriving: nothing came for {timeout_s:g} s",
                    code="body_stalled", headers={"Connection": "close"})


def queue_full(retry_after_s: int) -> APIError:
    return APIError(
        429,
        "The server's waiting queue is full; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def not_ready(reason: str) -> APIError:
    return APIError(503, reason, type="service_unavailable", code="not_ready")


def generation_failed(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="generation_error")
