"""The OpenAPI 3.1 document of the server, built from the route table and the pydantic models."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeAlias

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from sluice.app.schemas import ErrorResponse

ERROR_STATUSES = (
    ("400", "Invalid request: a field out of range, a prompt too long for the context, a failed chat template"),
    ("401", "Missing or wrong API key"),
    ("404", "Unknown model, or no stored response, conversation or item with that id"),
    ("413", "Body too large"),
    ("429", "Waiting queue full (Retry-After)"),
    ("500", "Generation failed in the engine"),
    ("503", "Loading, shutting down, or aborted by the server"),
)
# Anthropic's routes say a full queue as Anthropic says an overload (`anthropic_errors.py`).
ANTHROPIC_ERROR_STATUSES = tuple(("529" if status == "429" else status, text) for status, text in ERROR_STATUSES)


# A body's model, or the models one of which it is (`/invocations`'s).
Models: TypeAlias = type[BaseModel] | tuple[type[BaseModel], ...]


@dataclass(frozen=True)
class Operation:
    """What a route takes and returns. `stream_chunk`: with `stream: true` the route answers with
    `text/event-stream`, each event's data one such chunk (or an error, then `[DONE]`); a tuple of models for a body
    that is any one of them;
    `media_type` for a response that is not JSON (its schema is then a string); `error`: the body of its errors,
    `error_statuses` their statuses; `query`: the model of its query string's parameters."""

    path: str
    method: str
    summary: str
    request: Models | None = None
    response: Models | None = None
    stream_chunk: Models | None = None
    media_type: str = "application/json"
    error: type[BaseModel] = ErrorResponse
    error_statuses: tuple[tuple[str, str], ...] = ERROR_STATUSES
    query: type[BaseModel] | None = None


def _event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI before 3.2 describes each event with the media type's `schema`)."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}, "event": {"type": "string"}},
    }


def path_template(route_path: str) -> str:
    """A Starlette route's path as OpenAPI writes it: without the parameters' convertors ("{id:path}" -> "{id}")."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", route_path)


def openapi_document(operations: list[Operation], title: str, version: str, bearer_auth: bool,
                     open_paths: frozenset[str]) -> dict[str, Any]:
    """With `bearer_auth`, every path but `open_paths` needs `Authorization: Bearer <key>` (or `x-api-key: <key>`,
    as Anthropic's clients send it)."""
    models = {m for op in operations for body in (op.request, op.response, op.stream_chunk, op.error)
              for m in _each(body)}
    keys = sorted(((m, "validation" if _is_request(m, operations) else "serialization") for m in models),
                  key=lambda key: key[0].__name__)
    refs, definitions = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    by_model = {model: schema for (model, _), schema in refs.items()}

    def ref(models: Models) -> dict[str, Any]:
        schemas = [by_model[model] for model in _each(models)]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        error = {"content": {"application/json": {"schema": ref(op.error)}}}
        success: dict[str, Any] = {"description": "OK"}
        if op.response is not None:
            success["content"] = {op.media_type: {"schema": ref(op.response)}}
        elif op.media_type != "application/json":
            success["content"] = {op.media_type: {"schema": {"type": "string"}}}
        if op.stream_chunk is not None:
            event = _event_schema(ref(op.stream_chunk), ref(op.error))
            success["content"]["text/event-stream"] = {"schema": event}
        operation: dict[str, Any] = {
            "summary": op.summary,
            "responses": {"200": success, **{status: {"description": text, **error}
                                             for status, text in op.error_statuses}},
        }
        if bearer_auth and op.path in open_paths:
            operation["security"] = []
        path = path_template(op.path)
        if names := re.findall(r"\{(\w+)\}", path):
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in names]
        if op.query is not None:
            operation["parameters"] = operation.get("parameters", []) + _query_parameters(op.query)
        if op.request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(op.request)}}}
        paths.setdefault(path, {})[op.method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
    if bearer_auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                      "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        document["security"] = [{"bearer": []}, {"apiKey": []}]
    return document


def _query_parameters(query: type[BaseModel]) -> list[dict[str, Any]]:
    """A query model's fields as OpenAPI query parameters (flat fields only: a list repeats its key)."""
    schema = query.model_json_schema()
    assert "$defs" not in schema, f"{query.__name__}: a query's fields are flat"
    required = set(schema.get("required", ()))
    return [{"name": name, "in": "query", "required": name in required, "schema": field}
            for name, field in schema["properties"].items()]


def _each(models: Models | None) -> tuple[type[BaseModel], ...]:
    return () if models is None else models if isinstance(models, tuple) else (models,)


def _is_request(model: type[BaseModel], operations: list[Operation]) -> bool:
    return any(model in _each(op.request) for op in operations)
