"""Engine increments shaped into a Responses API response, whole (`collect`) or as its SSE events (`events`).

Both walk the same events: with a --reasoning-parser the reply's reasoning goes into a `reasoning` item first
(one `reasoning_text` part, no summary), its text into a `message` item (one `output_text` part), each tool call
into a `function_call` item, in the order the model wrote them; the reply is read as on the chat path
(`ReplyReader`), so streamed and whole replies read alike. A reply cut by `max_output_tokens` is `incomplete`.
With logprobs asked for, each token's logprob goes with the text it produced (the output text's `logprobs`, and
each `output_text.delta`'s); those of reasoning's and a call's tokens and of the token that stops the reply are not
output text, and are left out.
Streamed, each event is `event: <type>` then `data: <json>` with a `sequence_number`; an error after the 200
becomes a `response.failed` event carrying the error. A background response cancelled mid-way (`Generation.cancel`)
ends with a `response.incomplete` event carrying it `cancelled`: the stream events of OpenAI's API (and its clients'
event union) have no `response.cancelled`, and a cancelled response's partial output is kept, not failed.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_json

from sluice.batching.outputs import TokenLogprob, Usage
from sluice.model.tokenizer import Tokenizer

from sluice.app.errors import as_api_error
from sluice.app.generation import Generation
from sluice.app.response_ids import new_id, replica_of
from sluice.app.responses_api_schemas import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningTextPart,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from sluice.app.reasoning import ReasoningFormat, ReplyReader, Thought
from sluice.app.schemas import TokenLogprobInfo
from sluice.app.tool_call_streams import ArgumentsDelta, CallStart, StreamEvent, TextDelta
from sluice.app.tool_calls import ToolCalling, new_call_id

Event = dict[str, Any]
LogprobsOf = Callable[[Sequence[TokenLogprob]], list[TokenLogprobInfo]]
Item = OutputReasoning | OutputMessage | OutputFunctionCall


@dataclass(frozen=True)
class _Logprobs:
    """An increment's token logprobs, ahead of the text events they belong to."""

    entries: list[TokenLogprobInfo]


def stream_event(event: Event, sequence_number: int) -> bytes:
    """The SSE event `event: <type>`, `data: <ResponseStreamEvent(**event, sequence_number=...)'s JSON>`, its JSON
    serialized without building the model (its two fields first, then the event's in order): there is an event
    per token, and building the model cost the event loop 10 us of each."""
    data = to_json({"type": event["type"], "sequence_number": sequence_number, **event})
    return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"


def response_usage(usage: Usage, reasoning_tokens: int = 0) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class ResponsesBuilder:
    """`response` is the response in progress or queued (no output yet); once the reply has ended it is completed in
    place and handed to `on_done` (None: its owner stores it), streamed or not; a stream that fails marks it failed in
    place (one cancelled, cancelled) and hands it to `on_done` too, each before the stream's last event. `logprobs`: how token logprobs are shown (None: the request did
    not ask for them); `reasoning`: how the reply's reasoning is told (None: no --reasoning-parser); `tokenizer`: the
    vocabulary of the reply's tokens, in which `reasoning` counts those of the reasoning (the usage's
    `reasoning_tokens`), needed with it."""

    def __init__(self, response: ResponseObject, tool_calling: ToolCalling | None,
                 on_done: Callable[[ResponseObject], None] | None, logprobs: LogprobsOf | None = None,
                 reasoning: ReasoningFormat | None = None, tokenizer: Tokenizer | None = None) -> None:
        self._response = response
        self._tool_calling = tool_calling
        self._on_done = on_done
        self._logprobs = logprobs
        self._reasoning = reasoning
        self._tokenizer = tokenizer

    async def collect(self, generation: Generation) -> ResponseObject:
        async for _ in self._events(generation):
            pass
        return self._response

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return self._stream(generation)

    async def _stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        numbers = itertools.count()

        def frame(event: Event) -> bytes:
            return stream_event(event, next(numbers))

        yield frame({"type": "response.created", "response": self._response})
        self._response.status = "in_progress"  # a background response was created queued
        yield frame({"type": "response.in_progress", "response": self._response})
        try:
            async for event in self._events(generation):
                yield frame(event)
        except Exception as caught:  # noqa: BLE001 - the client hears why its stream ended
            if generation.cancelled:
                self._response.status = "cancelled"
                kind = "incomplete"
            else:
                error = as_api_error(caught, "a response stream")
                self._response.status = kind = "failed"
                self._response.error = ResponseError(code="server_error", message=error.message)
            self._done()
            yield frame({"type": f"response.{kind}", "response": self._response})
            return
        yield frame({"type": f"response.{self._response.status}", "response": self._response})

    async def _events(self, generation: Generation) -> AsyncGenerator[Event, None]:
        output = _Output(self._response.output, replica_of(self._response.id))
        finish_reason = None
        token_ids: list[int] = []  # the reply's, whose reasoning's the usage counts
        async for event in self._reply(generation, token_ids):
            if isinstance(event, str):
                finish_reason = event
            else:
                for out in output.add(event):
                    yield out
        incomplete = finish_reason == "length"
        for out in output.close(incomplete):
            yield out
        self._response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            self._response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        counted = 0 if self._reasoning is None else self._reasoning.count_tokens(self._tokenizer, token_ids)
        self._response.usage = response_usage(generation.usage, counted)
        self._done()

    def _done(self) -> None:
        if self._on_done is not None:
            self._on_done(self._response)

    async def _reply(self, generation: Generation, token_ids: list[int]
                     ) -> AsyncIterator[Thought | StreamEvent | _Logprobs | str]:
        """The reply as thoughts, text deltas, call starts and arguments fragments (each increment's logprobs first,
        if asked for), then its finish reason; its token ids are added to `token_ids` as they come."""
        reader = ReplyReader(self._reasoning, self._tool_calling)
        held: list[TokenLogprobInfo] = []  # of tokens whose text the reader holds (it may yet start the answer)
        async for increment in generation.increments():
            token_ids += increment.token_ids
            answering, answered = reader.answering, reader.answered
            events = reader.push(increment.text)
            if increment.finish_reason is not None:
                events += reader.finish()
            if self._logprobs is not None and increment.logprobs:
                # The token that stops a reply is not shown, whichever increment it comes in (alone, or with
                # the text before it), and neither is its logprob.
                shown = self._logprobs(increment.logprobs[:-1] if increment.finish_reason == "stop"
                                       else increment.logprobs)
                if not answering:  # the answer's tokens are the last of those whose bytes its text is
                    pending = held + shown
                    start = _answer_start(pending, reader.answered - answered)
                    # Once the reply answers or thinks, the tokens before the answer were no answer's.
                    settled = reader.answering or any(isinstance(event, Thought) for event in events)
                    held, shown = ([] if settled else pending[:start]), pending[start:]
                yield _Logprobs(shown)
            for event in events:
                yield event
            if increment.finish_reason is not None:
                yield increment.finish_reason


def _answer_start(entries: list[TokenLogprobInfo], length: int) -> int:
    """Where the last of `entries` whose bytes make up `length` bytes of answer begin (the answer comes after the
    reasoning, its tags and the blank after them, whose tokens' logprobs are left out)."""
    start, taken = len(entries), 0
    while start > 0 and taken < length:
        start -= 1
        taken += len(entries[start].bytes)
    return start


class _Output:
    """The output items as they arrive (appended to `items`), and the events that add, fill and close them (items
    in events are dumped when the event is made: the item changes as it fills)."""

    def __init__(self, items: list[Item], replica: str | None) -> None:
        self._items = items
        self._replica = replica  # the one the response's id names, which its items' ids name too
        self._open: Item | None = None
        self._logprobs: list[TokenLogprobInfo] = []  # of tokens whose text has not come yet

    def add(self, event: Thought | StreamEvent | _Logprobs) -> list[Event]:
        if isinstance(event, _Logprobs):
            self._logprobs += event.entries
            return []
        if isinstance(event, Thought):  # its tokens' logprobs were left out (`_answers`)
            events = [] if isinstance(self._open, OutputReasoning) else (self._close("completed")
                                                                         + self._open_reasoning())
            self._open.content[0].text += event.text
            return events + [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                              "delta": event.text}]
        if isinstance(event, TextDelta):
            events = [] if isinstance(self._open, OutputMessage) else self._close("completed") + self._open_message()
            logprobs, self._logprobs = self._logprobs, []
            self._open.content[0].text += event.text
            self._open.content[0].logprobs += logprobs
            return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0,
                              "delta": event.text, "logprobs": logprobs}]
        self._logprobs = []
        if isinstance(event, CallStart):
            call = OutputFunctionCall(id=new_id("fc", self._replica), status="in_progress", call_id=new_call_id(),
                                      name=event.name, arguments="")
            return self._close("completed") + self._add(call)
        assert isinstance(event, ArgumentsDelta) and isinstance(self._open, OutputFunctionCall)
        self._open.arguments += event.text
        return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": event.text}]

    def close(self, incomplete: bool) -> list[Event]:
        """The events that close the last item; a reply with no items gets an empty message. In a reply cut
        short the last item is incomplete, unless it is a call written whole (only what follows it was cut)."""
        events = self._open_message() if not self._items else []
        cut = incomplete and not _written_whole(self._open)
        return events + self._close("incomplete" if cut else "completed")

    def _open_message(self) -> list[Event]:
        return self._open_with_part(OutputMessage(id=new_id("msg", self._replica), status="in_progress", content=[]),
                                    OutputText(text=""))

    def _open_reasoning(self) -> list[Event]:
        return self._open_with_part(OutputReasoning(id=new_id("rs", self._replica), status="in_progress", content=[]),
                                    ReasoningTextPart(text=""))

    def _open_with_part(self, item: OutputMessage | OutputReasoning, part: OutputText | ReasoningTextPart
                        ) -> list[Event]:
        """The events that add `item` and then its one text part (the item is added without it, as OpenAI's)."""
        events = self._add(item)
        item.content.append(part)
        return events + [{"type": "response.content_part.added", **self._where(), "content_index": 0,
                          "part": part.model_dump()}]

    def _add(self, item: Item) -> list[Event]:
        self._items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self._items) - 1,
                 "item": item.model_dump()}]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        self._open = None
        item.status = status
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": part.text,
                       "logprobs": part.logprobs},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part.model_dump()}]
        elif isinstance(item, OutputReasoning):
            part = item.content[0]
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part.text},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part.model_dump()}]
        else:
            events = [{"type": "response.function_call_arguments.done", **where, "name": item.name,
                       "arguments": item.arguments}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": item.model_dump()}]

    def _where(self) -> Event:
        return {"item_id": self._open.id, "output_index": len(self._items) - 1}


def _written_whole(item: Item | None) -> bool:
    """Whether `item` is a call whose arguments are a whole JSON object: a call's arguments go out without the
    object's closing braces until it has closed, so a call cut short never parses."""
    if not isinstance(item, OutputFunctionCall):
        return False
    try:
        return isinstance(json.loads(item.arguments), dict)
    except ValueError:
        return False
