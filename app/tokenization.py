"""POST /tokenize and POST /detokenize with the served model's tokenizer."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from app.parsing import parse_body
from app.prompts import chat_prompt, check_token_ids
from app.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from app.state import ServerState


async def tokenize(request: Request) -> Response:
    """`prompt` is encoded as it is; `messages` are first rendered with the chat template."""
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        ids = chat_prompt(engine.tokenizer, body.messages, body.add_generation_prompt).token_ids
    else:
        ids = engine.tokenizer.encode(body.prompt)
    result = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)
    return Response(result.model_dump_json(), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    check_token_ids(engine.tokenizer, body.tokens, param="tokens")
    result = DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))
    return Response(result.model_dump_json(), media_type="application/json")
