"""Engine increments shaped into Anthropic's `message`, whole (`collect`) or as its stream of events (`events`).

The reply's text is read for tool calls as on the chat route (`ToolCalling`): calls become `tool_use` blocks with
their input parsed, the text around them `text` blocks, in the reply's order (whole or streamed alike). Streamed,
each block opens with `content_block_start`, grows by `text_delta`s or `input_json_delta`s and closes with
`content_block_stop`; `message_delta` then carries the stop reason (with the stop sequence that ended the reply, if
one did) and usage. A `ping` follows `message_start`, as in Anthropic's streams. An error during a stream becomes
an `error` event.

Usage splits the prompt as Anthropic does: `input_tokens` are the tokens computed, `cache_read_input_tokens` those the
prefix cache held. The engine reports the split when the reply ends, so a stream's `message_start` counts the whole
prompt as input, and its `message_delta` (whose counts replace them, as Anthropic's clients read them) gives the split.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import BaseModel

from sluice.batching.outputs import FinishReason, Increment

from sluice.app.anthropic_errors import anthropic_error_event
from sluice.app.anthropic_schemas import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    PingEvent,
    StopReason,
    TextBlock,
    TextDeltaBody,
    ToolUseBlock,
)
from sluice.app.errors import as_api_error
from sluice.app.generation import Generation
from sluice.app.streaming import TextFrame
from sluice.app.tool_call_streams import ArgumentsDelta, CallStart, StreamEvent, TextDelta
from sluice.app.tool_calls import ToolCalling


def sse(event: BaseModel) -> bytes:
    """One event as Anthropic frames it: its `type` on the `event:` line, the JSON on the `data:` line."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n".encode()


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict[str, Any]:
    """A call's input; `{}` for one that max_tokens cut off (a forced call streams its arguments as they come, so
    an unfinished one is still a call)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _opening(text: str, after_call: bool) -> str:
    """A text block's first text: after a call, without the whitespace that came between them (the reader holds
    whitespace until text follows, so it arrives at the start of the next text)."""
    return text.lstrip() if after_call else text


def _content(pieces: list[StreamEvent]) -> list[TextBlock | ToolUseBlock]:
    """The blocks a reader's events for a whole reply make, in order: the blocks `_Blocks` streams for them."""
    blocks: list[TextBlock | ToolUseBlock] = []
    arguments: dict[int, str] = {}  # a call's block's index -> its arguments so far
    for piece in pieces:
        if isinstance(piece, ArgumentsDelta):
            arguments[len(blocks) - 1] += piece.text
        elif isinstance(piece, CallStart):
            arguments[len(blocks)] = ""
            blocks.append(ToolUseBlock(id=new_tool_use_id(), name=piece.name, input={}))
        elif blocks and isinstance(blocks[-1], TextBlock):
            blocks[-1].text += piece.text
        else:
            blocks.append(TextBlock(text=_opening(piece.text, after_call=bool(blocks))))
    for index, text in arguments.items():
        blocks[index].input = _input(text)
    return blocks


class MessageBuilder:
    """One generation (one choice) as an Anthropic `message`. `input_tokens`: the prompt's length, known before
    the engine reports usage (`message_start` carries it); `calling`: what the text is read for (None: no tools)."""

    def __init__(self, message_id: str, model: str, input_tokens: int, calling: ToolCalling | None) -> None:
        self._id = message_id
        self._model = model
        self._input_tokens = input_tokens
        self._calling = calling
        self._num_tokens = 0
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None

    async def collect(self, generation: Generation) -> Message:
        text = ""
        async for increment in generation.increments():
            text += increment.text
            self._record(increment)
        if self._calling is None:
            pieces: list[StreamEvent] = [TextDelta(text)] if text else []
        else:
            reader = self._calling.stream()
            pieces = reader.push(text) + reader.finish()
        blocks = _content(pieces)
        stop_reason, stop_sequence = self._stop(any(isinstance(block, ToolUseBlock) for block in blocks))
        return self._message(blocks, stop_reason, stop_sequence, self._usage(generation))

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return self._events(generation)

    async def _events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        start = self._message([], None, None, MessageUsage(input_tokens=self._input_tokens, output_tokens=0))
        yield sse(MessageStartEvent(message=start))
        yield sse(PingEvent())
        blocks = _Blocks()
        reader = self._calling.stream() if self._calling is not None else None
        try:
            async for increment in generation.increments():
                self._record(increment)
                if reader is None:
                    pieces: list[StreamEvent] = [TextDelta(increment.text)] if increment.text else []
                else:
                    pieces = reader.push(increment.text) + (reader.finish() if increment.finished else [])
                for piece in pieces:
                    for event in blocks.add(piece):
                        yield event
            for event in blocks.close():
                yield event
            stop_reason, stop_sequence = self._stop(reader is not None and reader.calls > 0)
            yield sse(MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                                        usage=self._usage(generation)))
            yield sse(MessageStopEvent())
        except Exception as error:  # noqa: BLE001 - the client hears why its stream ended
            yield anthropic_error_event(as_api_error(error, "a message stream"))

    def _record(self, increment: Increment) -> None:
        self._num_tokens += len(increment.token_ids)
        self._finish = increment.finish_reason or self._finish
        self._stop_reason = increment.stop_reason

    def _stop(self, called: bool) -> tuple[StopReason, str | None]:
        if self._finish == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(self._stop_reason, str):
            return "stop_sequence", self._stop_reason
        return "end_turn", None

    def _usage(self, generation: Generation) -> MessageUsage:
        usage = generation.usage
        if usage is None:
            return MessageUsage(input_tokens=self._input_tokens, output_tokens=self._num_tokens)
        return MessageUsage(input_tokens=self._input_tokens - usage.cached_prompt_tokens,
                            cache_read_input_tokens=usage.cached_prompt_tokens, output_tokens=usage.completion_tokens)

    def _message(self, content: list[TextBlock | ToolUseBlock], stop_reason: StopReason | None,
                 stop_sequence: str | None, usage: MessageUsage) -> Message:
        return Message(id=self._id, model=self._model, content=content, stop_reason=stop_reason,
                       stop_sequence=stop_sequence, usage=usage)


class _Blocks:
    """The content blocks of a stream, as SSE events: a text delta goes to the open text block (opening one if a
    call or nothing is open), each call starts a tool_use block, and its arguments' fragments go to it.

    A text delta's event (one per token) differs from the block's others only in its text, so the JSON around the
    text is serialized once per block, from the schema, and each delta serializes its text alone."""

    def __init__(self) -> None:
        self._count = 0
        self._open: Literal["text", "tool_use"] | None = None
        self._text_frame: TextFrame | None = None

    def add(self, piece: StreamEvent) -> list[bytes]:
        if isinstance(piece, ArgumentsDelta):
            return [sse(ContentBlockDeltaEvent(index=self._count - 1, delta=InputJsonDelta(partial_json=piece.text)))]
        if isinstance(piece, TextDelta) and self._open == "text":
            return [self._text_frame.event(piece.text)]
        events = self.close()
        if isinstance(piece, TextDelta):
            index = self._count
            self._text_frame = TextFrame(
                lambda text: sse(ContentBlockDeltaEvent(index=index, delta=TextDeltaBody(text=text))))
            events += [sse(ContentBlockStartEvent(index=index, content_block=TextBlock(text=""))),
                       self._text_frame.event(_opening(piece.text, after_call=index > 0))]
            self._open = "text"
        else:
            block = ToolUseBlock(id=new_tool_use_id(), name=piece.name, input={})
            events.append(sse(ContentBlockStartEvent(index=self._count, content_block=block)))
            self._open = "tool_use"
        self._count += 1
        return events

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse(ContentBlockStopEvent(index=self._count - 1))]
