"""`POST /v1/embeddings`: each input's final hidden states, pooled and normalized to unit length.

The engine computes them as prefill-only requests (`SamplingParams.pooling`), batched with all other work on
the one model: a long input is prefilled in chunks like any prompt, and ends with the sum of its pooled tokens'
hidden states after the model's final norm. Pooling is the server's `ServerSettings.embedding_pooling`:
"last" (the default, as vLLM pools a decoder LM) takes the prompt's last token, whose state has attended to the
whole input; "mean" averages over every prompt token (such a request takes no pages from the prefix cache: it
needs every token's state). The vector is then scaled to unit L2 norm (a mean and a sum point the same way), so
cosine similarity is a dot product. `encoding_format: "base64"` sends its float32 values little-endian, the bytes
OpenAI's client decodes.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams

from sluice.app.embeddings_schemas import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from sluice.app.errors import invalid_request
from sluice.app.generation import Generation, start_generation
from sluice.app.prompts import truncated_prompts
from sluice.app.routes import json_response, parse_body
from sluice.app.schemas import Prompt
from sluice.app.state import ServerState
from sluice.app.streaming import cancel_on_disconnect


def normalized(pooled: np.ndarray) -> np.ndarray:
    """pooled: [D] float32, a sum of hidden states -> [D] float32 of unit L2 norm (zero stays zero)."""
    return pooled / max(float(np.linalg.norm(pooled)), np.finfo(np.float32).tiny)


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """As the response carries it: floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@dataclass(frozen=True)
class Embedded:
    """Each input's embedding, in input order, and the prompt tokens the engine computed for them."""

    vectors: list[np.ndarray]  # each [D] float32, unit length
    prompt_tokens: int


class EmbeddingOptions(Protocol):
    """The request fields that say how inputs are embedded (those of `/v1/embeddings`, `/score` and `/rerank`)."""

    model: str | None
    truncate_prompt_tokens: int | None
    add_special_tokens: bool


async def tokenized(engine: Engine, inputs: Prompt, options: EmbeddingOptions) -> list[list[int]]:
    """Each input's token ids, truncated as `options.truncate_prompt_tokens` asks (in a worker thread)."""
    prompts = await asyncio.to_thread(truncated_prompts, engine.tokenizer, inputs, options.truncate_prompt_tokens,
                                      engine.max_model_len, options.add_special_tokens)
    return [p.token_ids for p in prompts]


async def embed(request: Request, state: ServerState, prompts: list[list[int]], model: str | None, request_id: str,
                arrival: float, prompt_param: str) -> Embedded:
    """The engine's embeddings of `prompts`, with the LoRA adapter `model` names if it names one; `prompt_param`:
    the request's field a prompt too long for the context is in."""
    params = SamplingParams(max_tokens=0, temperature=0.0, pooling=state.settings.embedding_pooling)
    generation = await start_generation(request, state, prompts, params, request_id, arrival, model, prompt_param)
    try:
        pooled = await cancel_on_disconnect(request, _pooled(generation, len(prompts)))
    finally:
        await generation.close()
    return Embedded([normalized(p) for p in pooled], generation.usage.prompt_tokens)


async def create_embeddings(request: Request) -> Response:
    arrival = time.perf_counter()
    state, engine, body = await parse_body(request, EmbeddingRequest)
    hidden_size = engine.runner.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise invalid_request(f"dimensions must be the model's hidden size, {hidden_size} (got {body.dimensions})",
                              param="dimensions")
    prompts = await tokenized(engine, body.input, body)
    embedded = await embed(request, state, prompts, body.model, f"embd-{uuid.uuid4().hex}", arrival, "input")
    data = [Embedding(index=i, embedding=encoded(v, body.encoding_format)) for i, v in enumerate(embedded.vectors)]
    num_tokens = embedded.prompt_tokens
    return json_response(EmbeddingResponse(data=data, model=state.served_name(body.model),
                                           usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)))


async def _pooled(generation: Generation, num_inputs: int) -> list[np.ndarray]:
    """Each input's pooled sum ([D] float32), in input order."""
    pooled: list[np.ndarray | None] = [None] * num_inputs
    async for increment in generation.increments():
        pooled[increment.choice] = increment.embedding
    return pooled
