"""Reads a request's JSON body into a schema; malformed JSON and invalid fields become 400s."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from app.errors import from_validation_error, invalid_request

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, schema: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"The body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise invalid_request("The body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None
