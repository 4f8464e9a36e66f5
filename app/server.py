"""The Starlette app: route table, error handlers, middleware and lifespan.

Where a request goes: /v1/completions -> `completions.py`, /v1/chat/completions -> `chat.py`,
/tokenize and /detokenize -> `tokenization.py`; both generation routes drive the engine through
`generation.py` and stream with `sse.py`. `state.py` admits requests; `middleware.py` turns some away first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.chat import create_chat_completion
from app.completions import create_completion
from app.errors import APIError, error_response, not_ready
from app.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestCountMiddleware
from app.schemas import ModelCard, ModelList
from app.state import ServerState
from app.tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> Starlette:
    """An app serving `state`'s engine once `state.set_engine` has been called; 503 until then.

    On shutdown (after uvicorn has finished the open requests) it stops that engine.
    """
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    middleware = [Middleware(RequestCountMiddleware, metrics=state.metrics, routes=frozenset(r.path for r in routes))]
    if state.settings.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=state.settings.api_key))
    middleware.append(Middleware(BodySizeLimitMiddleware, max_bytes=state.settings.max_body_bytes))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if state.engine is not None:
            await state.engine.shutdown()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
        lifespan=lifespan,
    )
    app.state.sluice = state
    return app


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    if not state.ready:
        return error_response(not_ready("shutting down" if state.draining else "loading"))
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    card = ModelCard(id=state.model_name, created=int(time.time()), max_model_len=engine.max_model_len)
    return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error_response(error)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return error_response(APIError(error.status_code, error.detail, headers=dict(error.headers or {})))


async def _unexpected_error(request: Request, error: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(APIError(500, f"Internal server error: {error}", type="server_error"))
