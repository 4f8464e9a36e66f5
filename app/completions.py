"""POST /v1/completions: prompts in, text completions out (one JSON or an SSE stream)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from batching.request_output import TokenLogprob
from model.tokenizer import Tokenizer

from app.errors import APIError
from app.generation import Generation, respond
from app.logprobs import completion_logprobs
from app.parsing import parse_body
from app.prompts import Prompt, check_fits, completion_prompts
from app.sampling import sampling_params
from app.schemas import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, UsageInfo
from app.sse import DONE, sse_event
from app.state import ServerState

# OpenAI's default for the legacy completions API.
DEFAULT_MAX_TOKENS = 16


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.sluice
    engine = state.require_engine()
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    prompts = completion_prompts(engine.tokenizer, body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    check_fits(prompts, max_tokens, engine.max_model_len)
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0
    )
    admission = state.admit(len(prompts) * body.n)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation = Generation(engine, prompts, params, request_id, admission, state.metrics)
    builder = _CompletionBuilder(request_id, state.model_name, engine.tokenizer, body, prompts)
    return await respond(request, generation, builder, body.stream)


@dataclass
class _Choice:
    text: str = ""
    text_offset: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _CompletionBuilder:
    """Shapes engine increments into OpenAI completion responses and stream chunks."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer, body: CompletionRequest, prompts: list[Prompt]
    ) -> None:
        self._id = request_id
        self._created = int(time.time())
        self._model = model
        self._tokenizer = tokenizer
        self._body = body
        self._prompts = prompts
        self._num_choices = len(prompts) * body.n
        self._completion_tokens = 0

    async def collect(self, generation: Generation) -> CompletionResponse:
        choices = [self._new_choice(i) for i in range(self._num_choices)]
        async for out in generation.outputs():
            self._completion_tokens += len(out.output.token_ids)
            choice = choices[out.choice]
            choice.text += out.output.text
            choice.logprobs.extend(out.output.logprobs)
            choice.finish_reason = out.output.finish_reason or choice.finish_reason
        return self._response(
            [
                CompletionChoice(
                    index=i,
                    text=c.text,
                    logprobs=self._logprobs(c.logprobs, c.text_offset),
                    finish_reason=c.finish_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self._usage(),
        )

    async def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        offsets = [self._new_choice(i).text_offset for i in range(self._num_choices)]
        try:
            if self._body.echo:
                for i in range(self._num_choices):
                    yield self._chunk([CompletionChoice(index=i, text=self._prompts[i // self._body.n].text)])
            async for out in generation.outputs():
                self._completion_tokens += len(out.output.token_ids)
                logprobs = self._logprobs(list(out.output.logprobs), offsets[out.choice])
                offsets[out.choice] += sum(len(self._tokenizer.token_text(e.token_id)) for e in out.output.logprobs)
                yield self._chunk(
                    [
                        CompletionChoice(
                            index=out.choice,
                            text=out.output.text,
                            logprobs=logprobs,
                            finish_reason=out.output.finish_reason,
                        )
                    ]
                )
            if self._body.include_usage:
                yield self._chunk([], usage=self._usage())
        except APIError as error:
            yield sse_event(error.body())
        yield DONE

    def _new_choice(self, index: int) -> _Choice:
        echoed = self._prompts[index // self._body.n].text if self._body.echo else ""
        return _Choice(text=echoed, text_offset=len(echoed))

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int) -> CompletionLogprobs | None:
        if self._body.logprobs is None:
            return None
        return completion_logprobs(self._tokenizer, entries, text_offset)

    def _usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self._prompts)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=self._completion_tokens,
            total_tokens=prompt_tokens + self._completion_tokens,
        )

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        chunk = self._response(choices, usage)
        # With include_usage, OpenAI sends `"usage": null` on every chunk but the last; without, no key.
        return sse_event(chunk.model_dump_json(exclude=None if self._body.include_usage else {"usage"}))
