"""The Starlette app: route table (with its OpenAPI description), error handlers, middleware and lifespan.

Where a request goes: the middleware (CORS, then `middleware.py`: API key, body reading, counts) -> a route: the
OpenAI routes in `routes.py`, the small ones here -> for generation, `generation.py` drives the engine
(`batching/engine.py`) and `responses.py` shapes its output, streamed by `streaming.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sluice.app.dashboard import routes as dashboard
from sluice.app.anthropic_errors import error_response_for
from sluice.app.anthropic_messages import count_message_tokens, create_message
from sluice.app.anthropic_schemas import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
    MessageStreamEvent,
)
from sluice.app.dashboard.feed import Feed
from sluice.app.conversations import add_items, create_conversation, delete_conversation, delete_item, \
    get_conversation, get_item, list_items, update_conversation
from sluice.app.conversations_schemas import ConversationCreateRequest, ConversationObject, \
    ConversationUpdateRequest, DeletedConversation, IncludeQuery, ItemsCreateRequest
from sluice.app.embeddings import create_embeddings
from sluice.app.embeddings_schemas import EmbeddingRequest, EmbeddingResponse
from sluice.app.errors import APIError, error_response, not_ready
from sluice.app.invocations import invocations
from sluice.app.lora_admin import ERROR_STATUSES as LORA_ADMIN_ERROR_STATUSES, LoadLoraAdapterRequest, \
    UnloadLoraAdapterRequest, load_lora_adapter, unload_lora_adapter
from sluice.app.middleware import OPEN_PATHS, ApiKeyMiddleware, BodyReadMiddleware, InternalErrorMiddleware, \
    RequestCountMiddleware, RequestIdMiddleware
from sluice.app.openapi import ANTHROPIC_ERROR_STATUSES, Operation, openapi_document
from sluice.app.responses_api import cancel_response, count_input_tokens, create_response, delete_response, \
    get_response, list_input_items
from sluice.app.responses_api_schemas import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItemList,
    InputItemsQuery,
    InputTokenCount,
    InputTokensRequest,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponseStreamEvent,
    ResponsesRequest,
    RetrieveQuery,
)
from sluice.app.scores import create_rerank, create_score
from sluice.app.scores_schemas import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from sluice.app.routes import create_chat_completion, create_completion, detokenize, json_response, tokenize
from sluice.app.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from sluice.app.state import ServerState


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    return health_response(state.unready)


def health_response(unready: str | None) -> Response:
    """/health's answer (the replicas' ingress's too): 200, or 503 saying why not (`state.unready_reason`)."""
    return JSONResponse({"status": "ok"}) if unready is None else error_response(not_ready(unready))


async def server_version(request: Request) -> Response:
    return json_response(VersionResponse(version=version("sluice")))


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


def _model_cards(state: ServerState) -> list[ModelCard]:
    """The served model's card, then its LoRA adapters'."""
    engine = state.require_engine()
    created = int(time.time())
    return [ModelCard.of(state.model_name, created, engine.max_model_len, root=engine.config.model),
            *(ModelCard.of(name, created, engine.max_model_len, root=adapter.folder, parent=state.model_name)
              for name, adapter in engine.adapters.items())]


async def list_models(request: Request) -> Response:
    cards = _model_cards(request.app.state.sluice)
    return json_response(ModelList(data=cards, first_id=cards[0].id, last_id=cards[-1].id))


async def retrieve_model(request: Request) -> Response:
    """OpenAI's `models.retrieve`: the served model's or an adapter's card, 404 for any other id (an id may hold a
    "/")."""
    state: ServerState = request.app.state.sluice
    requested = request.path_params["model_id"]
    cards = _model_cards(state)
    state.check_model(requested)
    return json_response(next(card for card in cards if card.id == state.served_name(requested)))


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


Handler = Callable[[Request], Awaitable[Response]]
CONVERSATION = "/v1/conversations/{conversation_id}"

ROUTES: list[tuple[Handler, Operation]] = [
    (health, Operation("/health", "GET", "Readiness: 200 once the model serves, 503 while loading or draining",
                       response=HealthResponse)),
    (health, Operation("/ping", "GET", "/health by its other name (vLLM's, SageMaker's)", response=HealthResponse)),
    (health, Operation("/ping", "POST", "/health by its other name (vLLM's, SageMaker's)", response=HealthResponse)),
    (server_version, Operation("/version", "GET", "Sluice's version", response=VersionResponse)),
    (metrics, Operation("/metrics", "GET", "Prometheus metrics", media_type="text/plain")),
    (openapi, Operation("/openapi.json", "GET", "This document")),
    (list_models, Operation("/v1/models", "GET", "The served model", response=ModelList)),
    (retrieve_model, Operation("/v1/models/{model_id:path}", "GET", "The served model by its id",
                               response=ModelCard)),
    (create_completion, Operation("/v1/completions", "POST", "Text completion (OpenAI)",
                                  CompletionRequest, CompletionResponse, stream_chunk=CompletionResponse)),
    (create_chat_completion, Operation("/v1/chat/completions", "POST", "Chat completion (OpenAI)",
                                       ChatCompletionRequest, ChatCompletionResponse, stream_chunk=ChatCompletionChunk)),
    (create_message, Operation("/v1/messages", "POST", "Messages (Anthropic)", MessagesRequest, Message,
                               stream_chunk=MessageStreamEvent, error=AnthropicErrorResponse,
                               error_statuses=ANTHROPIC_ERROR_STATUSES)),
    (count_message_tokens, Operation("/v1/messages/count_tokens", "POST", "A Messages request's prompt length "
                                     "(Anthropic)", CountTokensRequest, CountTokensResponse,
                                     error=AnthropicErrorResponse, error_statuses=ANTHROPIC_ERROR_STATUSES)),
    (create_response, Operation("/v1/responses", "POST", "Create a response (OpenAI's Responses API)",
                                ResponsesRequest, ResponseObject, stream_chunk=ResponseStreamEvent)),
    (count_input_tokens, Operation("/v1/responses/input_tokens", "POST", "A response request's prompt length "
                                   "(OpenAI's Responses API)", InputTokensRequest, InputTokenCount)),
    (get_response, Operation("/v1/responses/{response_id}", "GET", "A stored response; with stream=true a background "
                             "response's events, those after starting_after", response=ResponseObject,
                             stream_chunk=ResponseStreamEvent, query=RetrieveQuery)),
    (delete_response, Operation("/v1/responses/{response_id}", "DELETE", "Deletes a stored response",
                                response=DeletedResponse)),
    (cancel_response, Operation("/v1/responses/{response_id}/cancel", "POST", "Cancels a background response (one "
                                "that has ended is answered as it is)", response=ResponseObject)),
    (list_input_items, Operation("/v1/responses/{response_id}/input_items", "GET", "A stored response's input "
                                 "items", response=InputItemList, query=InputItemsQuery)),
    (create_conversation, Operation("/v1/conversations", "POST", "Create a conversation, with its first items "
                                    "(OpenAI's Conversations API)", ConversationCreateRequest, ConversationObject)),
    (get_conversation, Operation(CONVERSATION, "GET", "A conversation", response=ConversationObject)),
    (update_conversation, Operation(CONVERSATION, "POST", "Replaces a conversation's metadata",
                                    ConversationUpdateRequest, ConversationObject)),
    (delete_conversation, Operation(CONVERSATION, "DELETE", "Deletes a conversation", response=DeletedConversation)),
    (add_items, Operation(f"{CONVERSATION}/items", "POST", "Adds items to a conversation, after its own",
                          ItemsCreateRequest, InputItemList, query=IncludeQuery)),
    (list_items, Operation(f"{CONVERSATION}/items", "GET", "A conversation's items", response=InputItemList,
                           query=InputItemsQuery)),
    (get_item, Operation(f"{CONVERSATION}/items/{{item_id}}", "GET", "An item of a conversation",
                         response=(MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem),
                         query=IncludeQuery)),
    (delete_item, Operation(f"{CONVERSATION}/items/{{item_id}}", "DELETE", "Deletes an item of a conversation "
                            "(answered with the conversation)", response=ConversationObject)),
    (create_embeddings, Operation("/v1/embeddings", "POST", "Embeddings: each input's pooled, normalized final "
                                  "hidden state (OpenAI)", EmbeddingRequest, EmbeddingResponse)),
    *((create_score, Operation(path, "POST", "vLLM's score: each text pair's cosine similarity of their embeddings "
                               "(1:1, 1:N or N:N)", ScoreRequest, ScoreResponse)) for path in ("/score", "/v1/score")),
    *((create_rerank, Operation(path, "POST", "Rerank (Jina's, Cohere's, as vLLM serves it): the documents by their "
                                "embeddings' cosine similarity to the query's", RerankRequest, RerankResponse))
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    (tokenize, Operation("/tokenize", "POST", "Prompt or messages to token ids", TokenizeRequest, TokenizeResponse)),
    (detokenize, Operation("/detokenize", "POST", "Token ids to text", DetokenizeRequest, DetokenizeResponse)),
    (invocations, Operation("/invocations", "POST", "SageMaker's inference route (beside /ping): a chat completion "
                            "(`messages`), completion (`prompt`), embeddings (`input`), score (`text_1`) or rerank "
                            "(`documents`) request, as that route",
                            (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ScoreRequest, RerankRequest),
                            (ChatCompletionResponse, CompletionResponse, EmbeddingResponse, ScoreResponse,
                             RerankResponse),
                            stream_chunk=(ChatCompletionChunk, CompletionResponse))),
]


LORA_ADMIN_ROUTES: list[tuple[Handler, Operation]] = [
    (load_lora_adapter, Operation("/v1/load_lora_adapter", "POST", "Loads a LoRA adapter, served under its name "
                                  "(vLLM's runtime LoRA updating)", LoadLoraAdapterRequest, media_type="text/plain",
                                  error_statuses=LORA_ADMIN_ERROR_STATUSES)),
    (unload_lora_adapter, Operation("/v1/unload_lora_adapter", "POST", "Unloads a LoRA adapter (vLLM's runtime LoRA "
                                    "updating)", UnloadLoraAdapterRequest, media_type="text/plain",
                                    error_statuses=LORA_ADMIN_ERROR_STATUSES)),
]
"""The routes of runtime LoRA updating (`app/lora_admin.py`), which an app has only with it on."""


def create_app(state: ServerState, cors: bool = True, lora_admin: bool = False) -> Starlette:
    """An app serving `state`'s engine once `state.set_engine` has been called; 503 until then. `cors`: the app
    applies the settings' CORS policy (a replica's does not: its ingress answers browsers). `lora_admin`: it has the
    routes that load and unload LoRA adapters (`LORA_ADMIN_ROUTES`), for an engine that allows runtime updating.

    With `settings.ui`, the dashboard's feed ticks while the app runs. On shutdown (after uvicorn has finished
    the open requests) it stops that engine.
    """
    settings = state.settings
    ui = settings.ui
    table = ROUTES + LORA_ADMIN_ROUTES if lora_admin else ROUTES
    routes = [Route(op.path, handler, methods=[op.method]) for handler, op in table]
    if ui:
        routes += dashboard.ui_routes()
    # Outermost: a browser's preflight is answered before the API key is asked for, and errors carry the CORS
    # headers too, so a page can read why its request failed.
    middleware = [Middleware(CORSMiddleware, **settings.cors_options())] if cors else []
    middleware += [Middleware(RequestIdMiddleware), Middleware(InternalErrorMiddleware),
                   Middleware(RequestCountMiddleware, metrics=state.metrics, routes=tuple(routes))]
    if settings.api_key:
        open_paths = OPEN_PATHS | dashboard.OPEN_PATHS if ui else OPEN_PATHS
        middleware.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths))
    middleware.append(Middleware(BodyReadMiddleware, max_bytes=settings.max_body_bytes))
    feed = Feed(state) if ui else None

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ticking = asyncio.ensure_future(feed.run()) if feed is not None else None
        try:
            yield
        finally:  # also where the lifespan's host ends it with an error (run-batch's driver may)
            if ticking is not None:
                ticking.cancel()
                await asyncio.gather(ticking, return_exceptions=True)
            if state.engine is not None:
                await state.engine.shutdown()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    # A path with a slash too many is an unknown route (`_http_error`), as OpenAI's API answers it: Starlette's
    # redirect to the route was in no API's shape, and a client that does not re-POST to it got nothing else.
    app.router.redirect_slashes = False
    app.state.sluice = state
    app.state.feed = feed
    app.state.openapi = openapi_document(
        [op for _, op in table], "Sluice", version("sluice"), bearer_auth=bool(settings.api_key),
        open_paths=OPEN_PATHS,
    )
    return app


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error_response_for(request.scope, error)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's errors (routing's 404 and 405): a 404 names the URL, as OpenAI's does."""
    assert isinstance(error, HTTPException)
    message = f"Invalid URL ({request.method} {request.url.path})" if error.status_code == 404 else error.detail
    return error_response_for(request.scope, APIError(error.status_code, message, headers=dict(error.headers or {})))
