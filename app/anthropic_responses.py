"""Engine increments shaped into Anthropic's `message`, whole (`collect`) or as its stream of events (`events`).

The reply's text is read as on the chat route (`ReplyReader`): with a --reasoning-parser, its reasoning is a
`thinking` block first; its calls become `tool_use` blocks with their input parsed, the text around them `text`
blocks, in the reply's order (whole or streamed alike). Streamed, each block opens with `content_block_start`,
grows by `thinking_delta`s, `text_delta`s or `input_json_delta`s and closes with `content_block_stop` (a thinking
block after a `signature_delta`, as Anthropic's); `message_delta` then carries the stop reason (with the stop
sequence that ended the reply, if one did) and usage. A `ping` follows `message_start`, as in Anthropic's streams.
An error during a stream becomes an `error` event.

Usage splits the prompt as Anthropic does: `input_tokens` are the tokens computed, `cache_read_input_tokens` those the
prefix cache held. The engine reports the split when the reply ends, so a stream's `message_start` counts the whole
prompt as input, and its `message_delta` (whose counts replace them, as Anthropic's clients read them) gives the split.
"""

from __future__ import annotations

import hashlib
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
    SignatureDelta,
    StopReason,
    TextBlock,
    TextDeltaBody,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from sluice.app.errors import as_api_error
from sluice.app.generation import Generation
from sluice.app.reasoning import ReasoningFormat, ReplyReader, Thought
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
    an unfinished one is still a call), cut where its text reads as JSON but no object (`[1, 2`, `-1`) too: a
    tool_use block's input is an object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _opening(text: str, after_block: bool) -> str:
    """A text block's first text: after a call, without the whitespace that came between them (the reader holds
    whitespace until text follows, so it arrives at the start of the next text); after the thinking, the reasoning
    stream has left it out already."""
    return text.lstrip() if after_block else text


def signature(thinking: str) -> str:
    """A thinking block's signature: its text's SHA-256 (so a stream's is the whole reply's)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _content(pieces: list[Thought | StreamEvent]) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
    """The blocks a reader's pieces for a whole reply make, in order: the blocks `_Blocks` streams for them."""
    thinking = "".join(piece.text for piece in pieces if isinstance(piece, Thought))  # all before the answer
    blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = (
        [ThinkingBlock(thinking=thinking, signature=signature(thinking))] if thinking else [])
    arguments: dict[int, str] = {}  # a call's block's index -> its arguments so far
    for piece in pieces:
        if isinstance(piece, Thought):
            continue
        if isinstance(piece, ArgumentsDelta):
            arguments[len(blocks) - 1] += piece.text
        elif isinstance(piece, CallStart):
            arguments[len(blocks)] = ""
            blocks.append(ToolUseBlock(id=new_tool_use_id(), name=piece.name, input={}))
        elif blocks and isinstance(blocks[-1], TextBlock):
            blocks[-1].text += piece.text
        else:
            blocks.append(TextBlock(text=_opening(piece.text, after_block=bool(blocks))))
    for index, text in arguments.items():
        blocks[index].input = _input(text)
    return blocks


class MessageBuilder:
    """One generation (one choice) as an Anthropic `message`. `input_tokens`: the prompt's length, known before
    the engine reports usage (`message_start` carries it); what the text is read for: `calling` (None: no tools)
    and `reasoning` (None: no --reasoning-parser)."""

    def __init__(self, message_id: str, model: str, input_tokens: int, calling: ToolCalling | None,
                 reasoning: ReasoningFormat | None = None) -> None:
        self._id = message_id
        self._model = model
        self._input_tokens = input_tokens
        self._calling = calling
        self._reasoning = reasoning
        self._num_tokens = 0
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None

    async def collect(self, generation: Generation) -> Message:
        text = ""
        async for increment in generation.increments():
            text += increment.text
            self._record(increment)
        reader = ReplyReader(self._reasoning, self._calling)
        blocks = _content(reader.push(text) + reader.finish())
        stop_reason, stop_sequence = self._stop(reader.calls > 0)
        return self._message(blocks, stop_reason, stop_sequence, self._usage(generation))

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return self._events(generation)

    async def _events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        start = self._message([], None, None, MessageUsage(input_tokens=self._input_tokens, output_tokens=0))
        yield sse(MessageStartEvent(message=start))
        yield sse(PingEvent())
        blocks = _Blocks()
        reader = ReplyReader(self._reasoning, self._calling)
        try:
            async for increment in generation.increments():
                self._record(increment)
                pieces = reader.push(increment.text) + (reader.finish() if increment.finished else [])
                for piece in pieces:
                    for event in blocks.add(piece):
                        yield event
            for event in blocks.close():
                yield event
            stop_reason, stop_sequence = self._stop(reader.calls > 0)
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

    def _message(self, content: list[ThinkingBlock | TextBlock | ToolUseBlock], stop_reason: StopReason | None,
                 stop_sequence: str | None, usage: MessageUsage) -> Message:
        return Message(id=self._id, model=self._model, content=content, stop_reason=stop_reason,
                       stop_sequence=stop_sequence, usage=usage)


class _Blocks:
    """The content blocks of a stream, as SSE events: a thought goes to the open thinking block (opening one first),
    a text delta to the open text block (opening one if another block or none is open), each call starts a
    tool_use block, and its arguments' fragments go to it.

    A thinking or text delta's event (one per token) differs from the block's others only in its text, so the JSON
    around the text is serialized once per block, from the schema, and each delta serializes its text alone."""

    def __init__(self) -> None:
        self._count = 0
        self._open: Literal["thinking", "text", "tool_use"] | None = None
        self._frame: TextFrame | None = None  # the open thinking or text block's delta event
        self._thinking = ""  # the open thinking block's text so far

    def add(self, piece: Thought | StreamEvent) -> list[bytes]:
        if isinstance(piece, ArgumentsDelta):
            return [sse(ContentBlockDeltaEvent(index=self._count - 1, delta=InputJsonDelta(partial_json=piece.text)))]
        if (isinstance(piece, Thought) and self._open == "thinking"
                or isinstance(piece, TextDelta) and self._open == "text"):
            return [self._delta(piece.text)]
        events = self.close()
        index = self._count
        if isinstance(piece, Thought):
            self._open, self._thinking = "thinking", ""
            self._frame = TextFrame(
                lambda text: sse(ContentBlockDeltaEvent(index=index, delta=ThinkingDelta(thinking=text))))
            events += [sse(ContentBlockStartEvent(index=index, content_block=ThinkingBlock(thinking="", signature=""))),
                       self._delta(piece.text)]
        elif isinstance(piece, TextDelta):
            self._open = "text"
            self._frame = TextFrame(
                lambda text: sse(ContentBlockDeltaEvent(index=index, delta=TextDeltaBody(text=text))))
            events += [sse(ContentBlockStartEvent(index=index, content_block=TextBlock(text=""))),
                       self._delta(_opening(piece.text, after_block=index > 0))]
        else:
            self._open = "tool_use"
            block = ToolUseBlock(id=new_tool_use_id(), name=piece.name, input={})
            events.append(sse(ContentBlockStartEvent(index=index, content_block=block)))
        self._count += 1
        return events

    def _delta(self, text: str) -> bytes:
        if self._open == "thinking":
            self._thinking += text
        return self._frame.event(text)

    def close(self) -> list[bytes]:
        """The open block's closing events: a thinking block's signature, then its stop."""
        if self._open is None:
            return []
        index = self._count - 1
        events = ([sse(ContentBlockDeltaEvent(index=index, delta=SignatureDelta(signature=signature(self._thinking))))]
                  if self._open == "thinking" else [])
        self._open = None
        return events + [sse(ContentBlockStopEvent(index=index))]
