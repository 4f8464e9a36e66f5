"""`POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`, `/v2/rerank`): vLLM's scores of text pairs for an
embedding model, the cosine similarity of the two texts' embeddings (`embeddings.py`: unit vectors, so a dot
product), and Jina's and Cohere's rerank over them.

Texts pair as vLLM pairs them: the one text_1 with each text_2 (1:N), or text_1[i] with text_2[i] (N:N); a rerank's
query with each document. All of a request's texts go to the engine as one request, each distinct text once however
many pairs hold it, so usage counts each embedded text's tokens once (vLLM's counts both texts of every pair).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from sluice.batching.engine import Engine

from sluice.app.embeddings import EmbeddingOptions, embed, tokenized
from sluice.app.embeddings_schemas import EmbeddingUsage
from sluice.app.routes import json_response, parse_body
from sluice.app.scores_schemas import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    as_list,
)
from sluice.app.state import ServerState


@dataclass(frozen=True)
class Scored:
    scores: list[float]  # one a pair, in pair order
    prompt_tokens: int  # the engine's, each distinct text counted once


async def create_score(request: Request) -> Response:
    arrival, created = time.perf_counter(), int(time.time())
    state, engine, body = await parse_body(request, ScoreRequest)
    request_id = f"score-{uuid.uuid4().hex}"
    scored = await _scored(request, state, engine, body, (as_list(body.text_1), as_list(body.text_2)),
                           ("text_1", "text_2"), request_id, arrival)
    data = [ScoreData(index=i, score=score) for i, score in enumerate(scored.scores)]
    return json_response(ScoreResponse(id=request_id, created=created, model=state.served_name(body.model),
                                       data=data, usage=_usage(scored)))


async def create_rerank(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, RerankRequest)
    request_id = f"rerank-{uuid.uuid4().hex}"
    scored = await _scored(request, state, engine, body, ([body.query], body.documents), ("query", "documents"),
                           request_id, arrival)
    results = [RerankResult(index=i, document=RerankDocument(text=text) if body.return_documents else None,
                            relevance_score=score)
               for i, (text, score) in enumerate(zip(body.documents, scored.scores))]
    results.sort(key=lambda result: result.relevance_score, reverse=True)  # stable: ties keep the input order
    top_n = body.top_n if body.top_n > 0 else len(results)
    return json_response(RerankResponse(id=request_id, model=state.served_name(body.model), usage=_usage(scored),
                                        results=results[:top_n]))


async def _scored(request: Request, state: ServerState, engine: Engine, options: EmbeddingOptions,
                  sides: tuple[list[str], list[str]], fields: tuple[str, str], request_id: str,
                  arrival: float) -> Scored:
    """The pairs of `sides` (1:N or N:N, as the schema allows), scored; `fields`: the request's names of the
    sides."""
    firsts, seconds = sides
    texts = list(dict.fromkeys(firsts + seconds))
    prompts = await tokenized(engine, texts, options)
    # The engine refuses the first prompt too long for the context, in `texts`' order: the first side's come first.
    too_long = next((text for text, prompt in zip(texts, prompts) if len(prompt) > engine.max_model_len), texts[0])
    prompt_param = fields[0] if too_long in firsts else fields[1]
    embedded = await embed(request, state, prompts, options.model, request_id, arrival, prompt_param)
    vectors = dict(zip(texts, embedded.vectors))
    pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)
    return Scored([float(vectors[first] @ vectors[second]) for first, second in pairs], embedded.prompt_tokens)


def _usage(scored: Scored) -> EmbeddingUsage:
    return EmbeddingUsage(prompt_tokens=scored.prompt_tokens, total_tokens=scored.prompt_tokens)
