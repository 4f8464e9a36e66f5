"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with a matching status."""

from __future__ import annotations

import logging
from typing import Any

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


def invalid_grammar(problem: str, param: str, json_schema: bool) -> APIError:
    """A grammar (a tool's parameters, a response format) that does not compile, naming the field that holds it;
    a JSON schema's with OpenAI's code for one."""
    return APIError(400, f"{param}: {problem}", param=param, code="invalid_json_schema" if json_schema else None)


def from_validation_error(error: ValidationError, body: Any = None) -> APIError:
    """The first pydantic complaint, with its field path (`messages.0.role`) as `param`: as the client wrote it in
    `body` (what was validated), when given."""
    first = error.errors()[0]
    loc = first["loc"]
    if body is not None:
        # A missing field, or the one a cross-field check names (`schemas.field_error`), may be absent from the body.
        named = first["type"] == "missing" or bool(loc) and (first.get("ctx") or {}).get("field") == loc[-1]
        loc = sent_path(loc, body, named)
    param = ".".join(str(part) for part in loc) or None
    message = f"{param}: {_said(first)}" if param else _said(first)
    return invalid_request(message, param)


def _said(error: Any) -> str:
    """A pydantic complaint's message; a check of Sluice's own (a ValueError) in its own words, without the
    "Value error, " pydantic puts before them."""
    raised = (error.get("ctx") or {}).get("error")
    return str(raised) if error["type"] == "value_error" and isinstance(raised, ValueError) else error["msg"]


def sent_path(loc: tuple[int | str, ...], body: Any, named: bool = False) -> tuple[int | str, ...]:
    """A pydantic error's location as a path in `body`: without the labels pydantic puts in it for a union's
    member, a tag (`response_format.json_schema.json_schema.name` is `response_format.json_schema.name`) or a type
    (`stop.str` is `stop`). Those are the parts that name nothing in `body`; where a part could be either (a tag
    that is also a key), the reading that keeps the error's own field, the location's last part, wins. `named`:
    the last part is a field's name even where `body` lacks it (a missing field's error)."""

    def walk(node: Any, rest: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
        """The kept parts of `rest` read from `node`, or None where its last part cannot be kept."""
        if not rest:
            return ()
        part, after = rest[0], rest[1:]
        if not after and named and isinstance(node, dict) and part not in node:
            return (part,)
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            child: Any = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            child = node[part]
        else:
            return walk(node, after) if after else None  # a label; the last part is never one that is kept
        kept = walk(child, after)
        if kept is not None:
            return (part, *kept)
        return walk(node, after) if after else None

    for length in range(len(loc), 0, -1):  # the whole location, else its longest readable head
        if (path := walk(body, tuple(loc[:length]))) is not None:
            return path
    return loc


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


def shutting_down() -> APIError:
    """A request that arrives while the server drains (the single process, or the replicas' ingress)."""
    return not_ready("The server is shutting down")


def generation_failed(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="generation_error")
