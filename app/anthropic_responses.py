"""Engine increments shaped into Anthropic's `message`, whole (`collect`) or as its stream of events (`events`).

The reply's text is read as on the chat route (`ReplyReader`): with a --reasoning-parser, its reasoning is a
`thinking` block first; its calls become `tool_use` blocks with their input parsed, the text around them `text`
blocks, in the reply's order (whole or streamed alike). Streamed, each block opens with `content_block_start`,
grows by `thinking_delta`s, `text_delta`s or `input_json_delta`s and closes with `content_block_stop` (a thinking
block after a `signature_delta`, as Anthropic's); `message_delta` then carries the stop reason (with the stop
sequence that ended the reply, if one did) and usage. A `ping` follows `message_start`, as in Anthropic's streams.
An error during a stream becomes an `error` event.

A call's input goes out one whole parameter at a time, as Anthropic streams it: a value still being written is held
back, so a call that max_tokens cuts short has as input the parameters it completed, whole or streamed alike (the
`anthropic` client's `get_final_message()` parses the streamed fragments into that object), where a value cut in the
middle (`"Par`, `12` of `123`) would be parsed as what it is not. A tool that asks for `eager_input_streaming`
(Anthropic's fine-grained tool streaming) has its input streamed as it is sampled instead, a cut value included;
its whole message still holds the completed parameters alone.

Usage splits the prompt as Anthropic does: `input_tokens` are the tokens computed, `cache_read_input_tokens` those the
prefix cache held. The engine reports the split when the reply ends, so a stream's `message_start` counts the whole
prompt as input, and its `message_delta` (whose counts replace them, as Anthropic's clients read them) gives the split.
With a --reasoning-parser, `output_tokens_details.thinking_tokens` counts the generated tokens that were the reply's
thinking, its tags included (`ReasoningFormat.count_tokens`: chat's `reasoning_tokens` and the tags'), in the whole
message and in `message_delta`.
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
    OutputTokensDetails,
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
from sluice.app.tool_call_streams import SURROGATE, ArgumentsDelta, CallStart, JsonNesting, StreamEvent, TextDelta
from sluice.app.tool_calls import ToolCalling
from sluice.model.tokenizer import Tokenizer


def sse(event: BaseModel) -> bytes:
    """One event as Anthropic frames it: its `type` on the `event:` line, the JSON on the `data:` line."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n".encode()


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class _Members:
    """A call's arguments as they arrive (JSON text of an object, cut short if max_tokens ends the reply first; a
    forced call's arguments arrive as they are sampled) and how far they hold complete members: up to the comma
    after the last member whose value has ended, or all of them once the object has closed. `push` gives the text
    that completes members, the input's `input_json_delta`s; `input()` is the object they hold. Text that is no
    object (`[1, 2`, `-1`), or stops being JSON (off a grammar), holds the members complete before it: a tool_use
    block's input is an object."""

    def __init__(self) -> None:
        self._text = ""
        self._complete = 0  # the length of the start of `_text` that holds whole members
        self._closed = False  # whether that start is the whole object
        self._broken = False  # whether the text stopped being an object's members
        self._scanned = 0
        self._nesting = JsonNesting()

    def push(self, text: str) -> str:
        self._text += text
        before = self._complete
        while self._scanned < len(self._text) and not (self._closed or self._broken):
            self._scan(self._text[self._scanned])
            self._scanned += 1
        return self._text[before:self._complete]

    def _scan(self, char: str) -> None:
        if not self._nesting.take(char):
            return
        depth = self._nesting.depth
        if char in "}]" and depth == 0:
            self._end(self._scanned + 1, closed=True)
        elif char == "," and depth == 1:
            self._end(self._scanned, closed=False)

    def _end(self, end: int, closed: bool) -> None:
        """A member ends at `end` (where the object closes, if `closed`): complete if what comes before is an
        object's members."""
        if _json_object(self._text[:end] if closed else self._text[:end] + "}") is None:
            self._broken = True
        else:
            self._complete, self._closed = end, closed

    def closing(self) -> str:
        """What closes the members `push` gave out into the object `input()` is, for a call cut short: so the
        input_json_deltas join to its JSON, as a client that parses them whole expects."""
        if self._closed:
            return ""
        return "}" if self._complete else "{}"

    def input(self) -> dict[str, Any]:
        held = self._text[:self._complete]
        return (_json_object(held if self._closed else held + "}") or {}) if held else {}


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None. A lone surrogate its strings escape (a model's `\\ud83d` without its
    pair) becomes U+FFFD: no UTF-8 response can carry it as a character, and the reply would not serialize."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _without_lone_surrogates(value) if isinstance(value, dict) else None


def _without_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    return value


class _LastCall:
    """The arguments of the reply's last call as they arrive, to tell whether the reply ended inside that call
    (`cut`: its arguments never closed into an object, as a stop sequence or max_tokens leaves a forced call)."""

    def __init__(self) -> None:
        self._arguments: str | None = None  # None: no call yet

    def add(self, piece: Thought | StreamEvent) -> None:
        if isinstance(piece, CallStart):
            self._arguments = ""
        elif isinstance(piece, ArgumentsDelta):
            self._arguments += piece.text

    @property
    def called(self) -> bool:
        return self._arguments is not None

    @property
    def cut(self) -> bool:
        return self.called and _json_object(self._arguments) is None


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
    arguments: dict[int, _Members] = {}  # a call's block's index -> its arguments
    for piece in pieces:
        if isinstance(piece, Thought):
            continue
        if isinstance(piece, ArgumentsDelta):
            arguments[len(blocks) - 1].push(piece.text)
        elif isinstance(piece, CallStart):
            arguments[len(blocks)] = _Members()
            blocks.append(ToolUseBlock(id=new_tool_use_id(), name=piece.name, input={}))
        elif blocks and isinstance(blocks[-1], TextBlock):
            blocks[-1].text += piece.text
        else:
            blocks.append(TextBlock(text=_opening(piece.text, after_block=bool(blocks))))
    for index, members in arguments.items():
        blocks[index].input = members.input()
    return [block for block in blocks if not (isinstance(block, TextBlock) and _blank(block.text))]


def _blank(text: str) -> bool:
    """Whether a text block of `text` would be whitespace alone: Anthropic refuses one in a request, so a reply
    holding one could not be sent back in the conversation. Such text is no block (Anthropic's replies have none)."""
    return not text.strip()


class MessageBuilder:
    """One generation (one choice) as an Anthropic `message`. `input_tokens`: the prompt's length, known before
    the engine reports usage (`message_start` carries it); what the text is read for: `calling` (None: no tools)
    and `reasoning` (None: no --reasoning-parser); `eager`: the tools whose calls stream their input as it is
    sampled (`eager_input_streaming`), not a whole parameter at a time; `tokenizer`: the vocabulary of the reply's
    tokens, in which `reasoning` counts those of the thinking (the usage's `thinking_tokens`; none without it);
    `windowed`: whether the context window, not the request's max_tokens, bounds the reply's length."""

    def __init__(self, message_id: str, model: str, input_tokens: int, calling: ToolCalling | None,
                 reasoning: ReasoningFormat | None = None, eager: frozenset[str] = frozenset(),
                 tokenizer: Tokenizer | None = None, windowed: bool = False) -> None:
        self._id = message_id
        self._eager = eager
        self._model = model
        self._input_tokens = input_tokens
        self._calling = calling
        self._reasoning = reasoning
        self._tokenizer = tokenizer
        self._windowed = windowed
        self._token_ids: list[int] = []  # the reply's, whose thinking's the usage counts
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None

    async def collect(self, generation: Generation) -> Message:
        text = ""
        async for increment in generation.increments():
            text += increment.text
            self._record(increment)
        reader, last_call = ReplyReader(self._reasoning, self._calling), _LastCall()
        pieces = reader.push(text) + reader.finish()
        for piece in pieces:
            last_call.add(piece)
        stop_reason, stop_sequence = self._stop(last_call)
        return self._message(_content(pieces), stop_reason, stop_sequence, self._usage(generation))

    def events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        return self._events(generation)

    async def _events(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        blocks = _Blocks(self._eager)
        reader, last_call = ReplyReader(self._reasoning, self._calling), _LastCall()
        try:
            start = self._message([], None, None, MessageUsage(input_tokens=self._input_tokens, output_tokens=0))
            yield sse(MessageStartEvent(message=start))
            yield sse(PingEvent())
            async for increment in generation.increments():
                self._record(increment)
                pieces = reader.push(increment.text) + (reader.finish() if increment.finished else [])
                for piece in pieces:
                    last_call.add(piece)
                    for event in blocks.add(piece):
                        yield event
            for event in blocks.close():
                yield event
            stop_reason, stop_sequence = self._stop(last_call)
            yield sse(MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                                        usage=self._usage(generation)))
            yield sse(MessageStopEvent())
        except Exception as error:  # noqa: BLE001 - the client hears why its stream ended
            yield anthropic_error_event(as_api_error(error, "a message stream"))

    def _record(self, increment: Increment) -> None:
        self._token_ids += increment.token_ids
        self._finish = increment.finish_reason or self._finish
        self._stop_reason = increment.stop_reason

    def _stop(self, last_call: _LastCall) -> tuple[StopReason, str | None]:
        if self._finish == "length":
            return "model_context_window_exceeded" if self._windowed else "max_tokens", None
        # A stop sequence that cut a call short ends the reply for itself (a call it cuts is no call to run), as
        # max_tokens does; one after complete calls (a ReAct "Observation:") leaves them to run.
        if isinstance(self._stop_reason, str) and (last_call.cut or not last_call.called):
            return "stop_sequence", self._stop_reason
        if last_call.called:
            return "tool_use", None
        return "end_turn", None

    def _usage(self, generation: Generation) -> MessageUsage:
        usage = generation.usage
        details = None if self._reasoning is None or self._tokenizer is None else OutputTokensDetails(
            thinking_tokens=self._reasoning.count_tokens(self._tokenizer, self._token_ids, tags=True))
        if usage is None:
            return MessageUsage(input_tokens=self._input_tokens, output_tokens=len(self._token_ids),
                                output_tokens_details=details)
        return MessageUsage(input_tokens=self._input_tokens - usage.cached_prompt_tokens,
                            cache_read_input_tokens=usage.cached_prompt_tokens, output_tokens=usage.completion_tokens,
                            output_tokens_details=details)

    def _message(self, content: list[ThinkingBlock | TextBlock | ToolUseBlock], stop_reason: StopReason | None,
                 stop_sequence: str | None, usage: MessageUsage) -> Message:
        return Message(id=self._id, model=self._model, content=content, stop_reason=stop_reason,
                       stop_sequence=stop_sequence, usage=usage)


class _Blocks:
    """The content blocks of a stream, as SSE events: a thought goes to the open thinking block (opening one first),
    a text delta to the open text block (opening one if another block or none is open), each call starts a
    tool_use block, and its arguments go to it as their members complete (as they arrive for an `eager` tool's).

    A thinking or text delta's event (one per token) differs from the block's others only in its text, so the JSON
    around the text is serialized once per block, from the schema, and each delta serializes its text alone."""

    def __init__(self, eager: frozenset[str] = frozenset()) -> None:
        self._eager = eager
        self._count = 0
        self._open: Literal["thinking", "text", "tool_use"] | None = None
        self._frame: TextFrame | None = None  # the open thinking or text block's delta event
        self._thinking = ""  # the open thinking block's text so far
        self._members: _Members | None = None  # the open tool_use block's arguments (None: an eager tool's)
        self._held = ""  # whitespace that would open a text block, held until text follows (see `_blank`)

    def add(self, piece: Thought | StreamEvent) -> list[bytes]:
        if isinstance(piece, ArgumentsDelta):
            out = piece.text if self._members is None else self._members.push(piece.text)
            return [sse(ContentBlockDeltaEvent(index=self._count - 1, delta=InputJsonDelta(partial_json=out)))
                    ] if out else []
        if (isinstance(piece, Thought) and self._open == "thinking"
                or isinstance(piece, TextDelta) and self._open == "text"):
            return [self._delta(piece.text)]
        if isinstance(piece, TextDelta):
            piece, self._held = TextDelta(self._held + piece.text), ""
            if _blank(piece.text):
                self._held = piece.text
                return []
        else:
            self._held = ""
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
            self._open, self._members = "tool_use", None if piece.name in self._eager else _Members()
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
        events = []
        if self._open == "thinking":
            delta = SignatureDelta(signature=signature(self._thinking))
            events.append(sse(ContentBlockDeltaEvent(index=index, delta=delta)))
        elif self._open == "tool_use" and self._members is not None and (closing := self._members.closing()):
            events.append(sse(ContentBlockDeltaEvent(index=index, delta=InputJsonDelta(partial_json=closing))))
        self._open = None
        return events + [sse(ContentBlockStopEvent(index=index))]
