"""`POST /invocations`: SageMaker's one inference route (beside `/ping`), as vLLM serves it: the body is a chat
completion, a completion, an embeddings, a score or a rerank request, answered by that route.

vLLM tries each request type in turn and takes the first that validates; here the field each type cannot do without
chooses (`messages`, then `prompt`, `input`, `text_1`, `documents`; a null one counts as absent, as the routes read
it), so a malformed request gets its own route's precise 400 rather than a list of the types it failed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from sluice.app.embeddings import create_embeddings
from sluice.app.errors import invalid_request
from sluice.app.routes import create_chat_completion, create_completion
from sluice.app.scores import create_rerank, create_score

# The field only that request type requires -> its route's handler, in vLLM's order.
INVOCATION_ROUTES: tuple[tuple[str, Callable[[Request], Awaitable[Response]]], ...] = (
    ("messages", create_chat_completion),
    ("prompt", create_completion),
    ("input", create_embeddings),
    ("text_1", create_score),
    ("documents", create_rerank),
)


async def invocations(request: Request) -> Response:
    """The handler of the route the body's fields name; a body that is not a JSON object goes to the chat route,
    whose parser says what is wrong with it. (Starlette keeps the body read here for the handler.)"""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return await create_chat_completion(request)
    if not isinstance(body, dict):
        return await create_chat_completion(request)
    for field, handler in INVOCATION_ROUTES:
        if body.get(field) is not None:
            return await handler(request)
    fields = ", ".join(f"`{field}`" for field, _ in INVOCATION_ROUTES)
    raise invalid_request(f"An /invocations body holds one of {fields}: a chat completion, a completion, an "
                          "embeddings, a score or a rerank request")
