"""Engine increments shaped into OpenAI responses: chat completions and text completions, whole or streamed.

A builder turns one `Generation` into either a single response (`collect`) or its SSE events (`events`);
an error during a stream becomes an error event before `[DONE]`. Usage is the engine's count (prompt tokens
once per prompt, cached prompt tokens as `prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sluice.batching.outputs import Increment, TokenLogprob, Usage
from sluice.model.tokenizer import Tokenizer

from sluice.app.errors import as_api_error
from sluice.app.generation import Generation
from sluice.app.prompts import Prompt
from sluice.app.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    FunctionCall,
    FunctionCallDelta,
    PromptLogprobs,
    PromptTokenLogprob,
    PromptTokensDetails,
    TokenLogprobInfo,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
)
from sluice.app.streaming import DONE, TextFrame, sse_event
from sluice.app.reasoning import ReasoningFormat, ReplyReader, Thought
from sluice.app.tool_call_streams import CallStart, StreamEvent, TextDelta
from sluice.app.tool_calls import ToolCalling, new_call_id


def usage_info(usage: Usage | None, reasoning_tokens: int | None = None) -> UsageInfo | None:
    """`reasoning_tokens`: with a --reasoning-parser, how many of the completion's tokens are reasoning."""
    if usage is None:
        return None
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
        completion_tokens_details=(None if reasoning_tokens is None
                                   else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)),
    )


@dataclass(frozen=True)
class TokenNames:
    """How logprobs name tokens: by their text, or (vLLM's `return_tokens_as_token_ids`) as "token_id:{id}", so
    tokens whose text is part of a character, or alike, are told apart."""

    tokenizer: Tokenizer
    as_ids: bool = False

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.token_text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode() if self.as_ids else self.tokenizer.token_bytes(token_id))


def token_logprobs(names: TokenNames, entries: Sequence[TokenLogprob]) -> list[TokenLogprobInfo]:
    """Sampled tokens' logprobs with their alternatives, in the shape chat and the Responses API share."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=names.text(token_id), logprob=logprob, bytes=names.bytes(token_id))

    return [TokenLogprobInfo(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
            for e in entries]


def vllm_prompt_logprobs(names: TokenNames, scored: tuple[TokenLogprob | None, ...], k: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of `Increment.prompt_logprobs`: per token, its entry then its `k` best
    alternatives' (ranked 1 to k), keyed by token id; null for the first token."""
    def entry(token_id: int, logprob: float, rank: int) -> PromptTokenLogprob:
        return PromptTokenLogprob(logprob=logprob, rank=rank, decoded_token=names.text(token_id))

    return [None] + [{str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
                     | {str(t): entry(t, lp, rank) for rank, (t, lp) in enumerate(e.top[:k], 1) if t != e.token_id}
                     for e in scored[1:]]


class ChunkFrame:
    """The SSE events of one stream's chunks. Its chunks differ only in their choices (and the last one's usage),
    so the JSON around the choices is serialized once, from the schema, and each event serializes its choices
    alone: half the cost of a chunk (RESULTS.md, 2026-11-27), paid for every token of every stream. Most chunks
    hold one choice with text alone (`text_event`): that choice's JSON around its text is serialized once per
    choice index too.

    With include_usage, OpenAI sends `"usage": null` on every chunk but the last; without, no key. With vLLM's
    continuous usage (`running`), each chunk with a choice has that choice's usage so far instead, serialized whole.
    """

    def __init__(self, empty: ChatCompletionChunk | CompletionResponse, include_usage: bool,
                 text_choice: Callable[[int, str], ChatChunkChoice | CompletionChoice],
                 running: RunningUsage | None = None) -> None:
        """`empty`: the stream's chunk with no choices and no usage; `text_choice(index, text)`: choice `index`
        with `text` and nothing else; `running`: the choices' usage so far, for continuous usage."""
        self._exclude = None if include_usage else {"usage"}
        self._empty = empty
        head, tail = empty.model_dump_json(exclude=self._exclude).split('"choices":[]')
        self._head = f'data: {head}"choices":['.encode()
        self._tail = f"]{tail}\n\n".encode()
        self._text_choice = text_choice
        self._text_frames: dict[int, TextFrame] = {}
        self._running = running

    def event(self, choices: list[ChatChunkChoice] | list[CompletionChoice]) -> bytes:
        if self._running is not None and choices:
            usage = self._running.of(choices[0].index)
            return self.whole_event(self._empty.model_copy(update={"choices": choices, "usage": usage}))
        return self._head + b",".join(choice.__pydantic_serializer__.to_json(choice) for choice in choices) + self._tail

    def text_event(self, index: int, text: str) -> bytes:
        """`event([text_choice(index, text)])`."""
        if self._running is not None:
            return self.event([self._text_choice(index, text)])
        frame = self._text_frames.get(index)
        if frame is None:
            frame = self._text_frames[index] = TextFrame(lambda mark: self.event([self._text_choice(index, mark)]))
        return frame.event(text)

    def whole_event(self, chunk: ChatCompletionChunk | CompletionResponse) -> bytes:
        """A chunk serialized whole: the last, with the usage, or a chat stream's first, with the prompt's ids."""
        return sse_event(chunk.model_dump_json(exclude=self._exclude))


class RunningUsage:
    """vLLM's `stream_options.continuous_usage_stats`: each choice's usage so far, its prompt's tokens and the tokens
    it has generated (`counted` counts them as they pass)."""

    def __init__(self, prompt_tokens: Sequence[int]) -> None:
        """`prompt_tokens`: per choice, its prompt's tokens."""
        self._prompt_tokens = prompt_tokens
        self._generated = [0] * len(prompt_tokens)

    def count(self, increment: Increment) -> None:
        self._generated[increment.choice] += len(increment.token_ids)

    async def counted(self, increments: AsyncIterator[Increment]) -> AsyncGenerator[Increment, None]:
        async for increment in increments:
            self.count(increment)
            yield increment

    def of(self, choice: int, unsent: int = 0) -> UsageInfo:
        """`choice`'s usage so far, less `unsent` tokens counted but not yet sent."""
        prompt, generated = self._prompt_tokens[choice], self._generated[choice] - unsent
        return UsageInfo(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


async def event_stream(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The chunks, then `[DONE]`; an error on the way (a failed generation, or a bug) becomes an error event
    first."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:  # noqa: BLE001 - the client hears why its stream ended
        yield sse_event(as_api_error(error, "a stream").body())
    yield DONE


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


async def _gather(generation: Generation, choices: list[_Choice]) -> None:
    """Each choice's text, token ids, logprobs (its prompt's too, when asked), finish and stop reason."""
    async for increment in generation.increments():
        choice = choices[increment.choice]
        choice.text += increment.text
        choice.token_ids.extend(increment.token_ids)
        choice.logprobs.extend(increment.logprobs)
        choice.prompt_logprobs = increment.prompt_logprobs or choice.prompt_logprobs
        choice.finish_reason = increment.finish_reason or choice.finish_reason
        choice.stop_reason = increment.stop_reason


def _call_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """`"tool_calls"` for a reply that made calls, except one that max_tokens cut (`"length"`, as OpenAI's: its
    last call may be unfinished)."""
    return "tool_calls" if called and finish_reason != "length" else finish_reason


class ChatBuilder:
    """`chat.completion` responses and `chat.completion.chunk` streams.

    With `reasoning`, each choice's reasoning is told from its answer (`app/reasoning.py`): `message.reasoning`
    (and `reasoning_content`), streamed as deltas of those. With `tool_calling`, the answer is read for calls: they
    become `message.tool_calls` (the rest of the text its `content`) and the finish reason `"tool_calls"`;
    streamed, each call's first delta carries its index, id, type and name, the next ones fragments of its
    arguments.
    """

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, body: ChatCompletionRequest,
                 prompt_ids: Sequence[int], tool_calling: ToolCalling | None = None,
                 reasoning: ReasoningFormat | None = None) -> None:
        self._id = request_id
        self._prompt_ids = list(prompt_ids) if body.return_token_ids else None
        self._prompt_ids_due = self._prompt_ids is not None  # on the stream's first chunk
        self._created = int(time.time())
        self._model = model
        self._names = TokenNames(tokenizer, body.return_tokens_as_token_ids)
        self._body = body
        self._tool_calling = tool_calling
        self._reasoning = reasoning
        self._tokenizer = tokenizer
        self._generated: list[list[int]] = [[] for _ in range(body.n)]  # each choice's token ids, streamed
        self._running = RunningUsage([len(prompt_ids)] * body.n) if body.continuous_usage else None
        self._frame = ChunkFrame(ChatCompletionChunk(id=request_id, created=self._created, model=model, choices=[]),
                                 body.include_usage,
                                 lambda i, text: ChatChunkChoice(index=i, delta=ChatDelta(content=text)), self._running)

    async def collect(self, generation: Generation) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(self._body.n)]
        await _gather(generation, choices)
        scored = choices[0].prompt_logprobs  # every choice's prompt is the one
        chat_choices = [self._choice(i, c) for i, c in enumerate(choices)]
        return ChatCompletionResponse(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=chat_choices,
            usage=usage_info(generation.usage, self._reasoning_tokens(c.token_ids for c in choices)),
            prompt_logprobs=(vllm_prompt_logprobs(self._names, scored, self._body.prompt_logprobs)
                             if scored is not None else None),
            prompt_token_ids=self._prompt_ids,
        )

    def _choice(self, index: int, choice: _Choice) -> ChatChoice:
        logprobs = self._logprobs(choice.logprobs)
        token_ids = self._token_ids(choice.token_ids)
        reasoning, answer = (None, choice.text) if self._reasoning is None else self._reasoning.split(choice.text)
        if self._tool_calling is None:
            content = answer if self._reasoning is None else answer or None
            message = ChatResponseMessage(content=content, reasoning=reasoning, reasoning_content=reasoning)
            return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=choice.finish_reason,
                              stop_reason=choice.stop_reason, token_ids=token_ids)
        content, calls = self._tool_calling.parse(answer)
        tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        message = ChatResponseMessage(content=content, tool_calls=tool_calls or None, reasoning=reasoning,
                                      reasoning_content=reasoning)
        return ChatChoice(index=index, message=message, logprobs=logprobs,
                          finish_reason=_call_finish_reason(choice.finish_reason, bool(calls)),
                          stop_reason=choice.stop_reason, token_ids=token_ids)

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return event_stream(self._chunks(generation))

    async def _chunks(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        # A reply read for calls opens when its first piece is known (`_read_chunks`), as OpenAI's: one that starts
        # with a call has its role on the call's chunk, with content null.
        if self._tool_calling is None:
            for i in range(self._body.n):
                yield self._opening(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        increments = generation.increments()
        if self._running is not None:
            increments = self._running.counted(increments)
        read = self._tool_calling is not None or self._reasoning is not None
        chunks = self._read_chunks(increments) if read else self._text_chunks(increments)
        async for chunk in chunks:
            yield chunk
        if self._body.include_usage:
            yield self._chunk([], usage=usage_info(generation.usage, self._reasoning_tokens(self._generated)))

    def _reasoning_tokens(self, token_ids: Iterable[Sequence[int]]) -> int | None:
        """How many of the choices' generated tokens (`token_ids`, each choice's) are their reasoning; None without a
        --reasoning-parser."""
        if self._reasoning is None:
            return None
        return sum(self._reasoning.count_tokens(self._tokenizer, ids) for ids in token_ids)

    async def _text_chunks(self, increments: AsyncIterator[Increment]) -> AsyncGenerator[bytes, None]:
        per_token = self._body.logprobs or self._body.return_token_ids
        async for increment in increments:
            if per_token and (increment.text or increment.token_ids):
                yield self._chunk([ChatChunkChoice(index=increment.choice, delta=ChatDelta(content=increment.text),
                                                   logprobs=self._logprobs(increment.logprobs),
                                                   token_ids=self._token_ids(increment.token_ids))])
            elif increment.text:
                yield self._frame.text_event(increment.choice, increment.text)
            if increment.finish_reason is not None:
                yield self._chunk([ChatChunkChoice(index=increment.choice, delta=ChatDelta(),
                                                   finish_reason=increment.finish_reason,
                                                   stop_reason=increment.stop_reason)])

    async def _read_chunks(self, increments: AsyncIterator[Increment]) -> AsyncGenerator[bytes, None]:
        """Replies read for reasoning or calls: one chunk per reasoning piece, text delta, call start or arguments
        fragment; an increment's logprobs and token ids ride on its first."""
        readers = [ReplyReader(self._reasoning, self._tool_calling) for _ in range(self._body.n)]
        # Choices not yet opened: with calls to read, each opens on its first chunk (`_opened`).
        unopened = set(range(self._body.n)) if self._tool_calling is not None else set()
        async for increment in increments:
            reader = readers[increment.choice]
            pieces = reader.push(increment.text) + (reader.finish() if increment.finish_reason is not None else [])
            self._generated[increment.choice] += increment.token_ids
            deltas = [self._delta(piece) for piece in pieces]
            if (increment.logprobs or self._body.return_token_ids and increment.token_ids) and not deltas:
                deltas = [ChatDelta()]  # for the logprobs or ids: no text, as the whole reply has none
            for j, delta in enumerate(deltas):
                logprobs, token_ids = ((self._logprobs(increment.logprobs), self._token_ids(increment.token_ids))
                                       if j == 0 else (None, None))
                choice = ChatChunkChoice(index=increment.choice, delta=delta, logprobs=logprobs, token_ids=token_ids)
                if increment.choice in unopened:
                    unopened.discard(increment.choice)
                    for chunk in self._opened(choice, len(increment.token_ids)):
                        yield chunk
                else:
                    yield self._chunk([choice])
            if increment.finish_reason is not None:
                finish_reason = _call_finish_reason(increment.finish_reason, reader.calls > 0)
                choice = ChatChunkChoice(index=increment.choice, delta=ChatDelta(), finish_reason=finish_reason,
                                         stop_reason=increment.stop_reason)
                if increment.choice in unopened:  # a reply with nothing to show: no text, as its message has none
                    unopened.discard(increment.choice)
                    choice.delta = ChatDelta(role="assistant", content=None)
                    yield self._opening(choice)
                else:
                    yield self._chunk([choice])

    def _opened(self, choice: ChatChunkChoice, tokens: int) -> list[bytes]:
        """The chunks of a choice's first delta (of an increment of `tokens` tokens), which opens the choice as
        OpenAI's streams do: a call (or logprobs or token ids alone) carries its role, with content null (the
        message's content is null unless text comes); text or reasoning come after an opening chunk of their own,
        the role with content ""."""
        delta = choice.delta
        if delta.content is None and delta.reasoning is None:
            choice.delta = ChatDelta(role="assistant", content=None, tool_calls=delta.tool_calls)
            return [self._opening(choice)]
        opening = ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))
        return [self._opening(opening, unsent=tokens), self._chunk([choice])]

    def _opening(self, choice: ChatChunkChoice, unsent: int = 0) -> bytes:
        """A choice's first chunk; the stream's first carries the prompt's token ids, if asked for (vLLM's).
        `unsent`: tokens already counted for continuous usage that only the next chunk brings."""
        prompt_ids = self._prompt_ids if self._prompt_ids_due else None
        self._prompt_ids_due = False
        if prompt_ids is None and not (self._running is not None and unsent):
            return self._chunk([choice])
        return self._frame.whole_event(ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=[choice],
            usage=self._running.of(choice.index, unsent) if self._running is not None else None,
            prompt_token_ids=prompt_ids))

    @staticmethod
    def _delta(event: Thought | StreamEvent) -> ChatDelta:
        if isinstance(event, Thought):
            return ChatDelta(reasoning=event.text, reasoning_content=event.text)
        if isinstance(event, TextDelta):
            return ChatDelta(content=event.text)
        if isinstance(event, CallStart):
            call = ToolCallDelta(index=event.index, id=new_call_id(), type="function",
                                 function=FunctionCallDelta(name=event.name, arguments=""))
        else:
            call = ToolCallDelta(index=event.index, function=FunctionCallDelta(arguments=event.text))
        return ChatDelta(tool_calls=[call])

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self._body.logprobs:
            return None
        return ChatLogprobs(content=token_logprobs(self._names, entries))

    def _token_ids(self, token_ids: Sequence[int]) -> list[int] | None:
        return list(token_ids) if self._body.return_token_ids else None

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        if usage is None:
            return self._frame.event(choices)
        return self._frame.whole_event(ChatCompletionChunk(id=self._id, created=self._created, model=self._model,
                                                           choices=choices, usage=usage))


class CompletionBuilder:
    """`text_completion` responses and their streams; choice `prompt * n + sample`."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, body: CompletionRequest,
                 prompts: list[Prompt]) -> None:
        self._id = request_id
        self._created = int(time.time())
        self._model = model
        self._names = TokenNames(tokenizer, body.return_tokens_as_token_ids)
        self._body = body
        self._prompts = prompts
        self._num_choices = len(prompts) * body.n
        self._unopened = set(range(self._num_choices)) if body.return_token_ids else set()
        self._running = (RunningUsage([len(prompts[i // body.n].token_ids) for i in range(self._num_choices)])
                         if body.continuous_usage else None)
        self._frame = ChunkFrame(self._response([]), body.include_usage,
                                 lambda i, text: CompletionChoice(index=i, text=text), self._running)

    async def collect(self, generation: Generation) -> CompletionResponse:
        choices = [_Choice(text=self._echo(i)) for i in range(self._num_choices)]
        await _gather(generation, choices)
        return self._response(
            [CompletionChoice(index=i, text=c.text, logprobs=self._choice_logprobs(i, c),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                              prompt_logprobs=self._vllm_prompt_logprobs(c), **self._token_ids(i, c.token_ids))
             for i, c in enumerate(choices)],
            usage=usage_info(generation.usage),
        )

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return event_stream(self._chunks(generation))

    async def _chunks(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        offsets = [len(self._echo(i)) for i in range(self._num_choices)]
        if self._body.echo and self._body.logprobs is None:  # else with its logprobs, which come with its first tokens
            for i in range(self._num_choices):
                yield self._chunk([CompletionChoice(index=i, text=self._echo(i), **self._token_ids(i, ()))])
        async for increment in generation.increments():
            if increment.prompt_logprobs is not None:  # echo with logprobs (vLLM's prompt_logprobs is not streamed)
                echoed = self._echoed_logprobs(increment.choice, increment.prompt_logprobs)
                yield self._chunk([CompletionChoice(index=increment.choice, text=self._echo(increment.choice),
                                                    logprobs=echoed, **self._token_ids(increment.choice, ()))])
            if self._running is not None:  # after its echo: that chunk has sent none of its tokens
                self._running.count(increment)
            if self._body.logprobs is None and not self._body.return_token_ids and increment.finish_reason is None:
                if increment.text:  # none yet: a character's first bytes, or text held back for a stop string
                    yield self._frame.text_event(increment.choice, increment.text)
                continue
            logprobs = self._logprobs(increment.logprobs, offsets[increment.choice])
            offsets[increment.choice] += sum(len(self._names.text(e.token_id)) for e in increment.logprobs)
            yield self._chunk([CompletionChoice(index=increment.choice, text=increment.text, logprobs=logprobs,
                                                finish_reason=increment.finish_reason,
                                                stop_reason=increment.stop_reason,
                                                **self._token_ids(increment.choice, increment.token_ids))])
        if self._body.include_usage:
            yield self._chunk([], usage=usage_info(generation.usage))

    def _echo(self, choice: int) -> str:
        return self._prompts[choice // self._body.n].text if self._body.echo else ""

    def _token_ids(self, choice: int, token_ids: Sequence[int]) -> dict[str, list[int]]:
        """vLLM's return_token_ids fields of a choice's chunk (or whole choice): its new ids, and on its first, its
        prompt's."""
        if not self._body.return_token_ids:
            return {}
        if choice not in self._unopened:
            return {"token_ids": list(token_ids)}
        self._unopened.discard(choice)
        return {"token_ids": list(token_ids), "prompt_token_ids": list(self._prompts[choice // self._body.n].token_ids)}

    def _vllm_prompt_logprobs(self, choice: _Choice) -> PromptLogprobs | None:
        k = self._body.prompt_logprobs
        if k is None or choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self._names, choice.prompt_logprobs, k)

    def _choice_logprobs(self, index: int, choice: _Choice) -> CompletionLogprobs | None:
        generated = self._logprobs(choice.logprobs, len(self._echo(index)))
        if generated is None or not self._body.echo or choice.prompt_logprobs is None:
            return generated
        return self._echoed_logprobs(index, choice.prompt_logprobs).then(generated)

    def _echoed_logprobs(self, index: int, scored: tuple[TokenLogprob | None, ...]) -> CompletionLogprobs:
        """Choice `index`'s echoed prompt's tokens (`scored`: `Increment.prompt_logprobs`), from offset 0; its
        first token has no logprob."""
        first = self._names.text(self._prompts[index // self._body.n].token_ids[0])
        opening = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        entries = [e._replace(top=e.top[:self._body.logprobs]) for e in scored[1:]]  # vLLM's may ask for more
        return opening.then(self._logprobs(entries, len(first)))

    def _logprobs(self, entries: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs | None:
        """As in OpenAI's API, each `top_logprobs` dict holds the k best tokens and the sampled one."""
        if self._body.logprobs is None:
            return None
        text = self._names.text
        tokens = [text(e.token_id) for e in entries]
        offsets = [text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        top = [{text(t): lp for t, lp in (*e.top, (e.token_id, e.logprob))} for e in entries]
        return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries], top_logprobs=top,
                                  text_offset=offsets)

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        if usage is None:
            return self._frame.event(choices)
        return self._frame.whole_event(self._response(choices, usage))
