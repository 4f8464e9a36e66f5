"""POST /v1/chat/completions: messages rendered with the model's chat template, one assistant reply
per choice (one JSON or an SSE stream of deltas)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from batching.request_output import TokenLogprob
from model.tokenizer import Tokenizer

from app.errors import APIError, invalid_request
from app.generation import Generation, respond
from app.logprobs import chat_logprobs
from app.parsing import parse_body
from app.prompts import Prompt, chat_prompt, check_fits
from app.sampling import sampling_params
from app.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    UsageInfo,
)
from app.sse import DONE, sse_event
from app.state import ServerState


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    prompt = chat_prompt(engine.tokenizer, body.messages)
    # Without a limit the reply may fill the rest of the context, as OpenAI's chat API allows.
    max_tokens = body.max_new_tokens if body.max_new_tokens is not None else engine.max_model_len - len(prompt.token_ids)
    if max_tokens < 1:
        raise invalid_request(
            f"The messages take {len(prompt.token_ids)} tokens, the whole context of {engine.max_model_len}",
            param="messages",
        )
    check_fits([prompt], max_tokens, engine.max_model_len)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, top_logprobs=body.top_logprobs)
    admission = state.admit(body.n)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = Generation(engine, [prompt], params, request_id, admission, state.metrics)
    builder = _ChatBuilder(request_id, state.model_name, engine.tokenizer, body, prompt)
    return await respond(request, generation, builder, body.stream)


@dataclass
class _Choice:
    content: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _ChatBuilder:
    """Shapes engine increments into OpenAI chat responses and `chat.completion.chunk`s."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer, body: ChatCompletionRequest, prompt: Prompt
    ) -> None:
        self._id = request_id
        self._created = int(time.time())
        self._model = model
        self._tokenizer = tokenizer
        self._body = body
        self._prompt = prompt
        self._completion_tokens = 0

    async def collect(self, generation: Generation) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(self._body.n)]
        async for out in generation.outputs():
            self._completion_tokens += len(out.output.token_ids)
            choice = choices[out.choice]
            choice.content += out.output.text
            choice.logprobs.extend(out.output.logprobs)
            choice.finish_reason = out.output.finish_reason or choice.finish_reason
        return ChatCompletionResponse(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content=c.content),
                    logprobs=self._logprobs(c.logprobs),
                    finish_reason=c.finish_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self._usage(),
        )

    async def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        try:
            for i in range(self._body.n):
                yield self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            async for out in generation.outputs():
                self._completion_tokens += len(out.output.token_ids)
                if out.output.text or out.output.logprobs:
                    yield self._chunk(
                        [
                            ChatChunkChoice(
                                index=out.choice,
                                delta=ChatDelta(content=out.output.text),
                                logprobs=self._logprobs(list(out.output.logprobs)),
                            )
                        ]
                    )
                if out.output.finish_reason is not None:
                    yield self._chunk(
                        [ChatChunkChoice(index=out.choice, delta=ChatDelta(), finish_reason=out.output.finish_reason)]
                    )
            if self._body.include_usage:
                yield self._chunk([], usage=self._usage())
        except APIError as error:
            yield sse_event(error.body())
        yield DONE

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(self._tokenizer, entries) if self._body.logprobs else None

    def _usage(self) -> UsageInfo:
        prompt_tokens = len(self._prompt.token_ids)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=self._completion_tokens,
            total_tokens=prompt_tokens + self._completion_tokens,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)
        # With include_usage, OpenAI sends `"usage": null` on every chunk but the last; without, no key.
        return sse_event(chunk.model_dump_json(exclude=None if self._body.include_usage else {"usage"}))
