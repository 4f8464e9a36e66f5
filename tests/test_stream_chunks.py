"""A stream's SSE chunks, serialized around their choices once per stream (`ChunkFrame`), are byte for byte the
events of the whole chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from sluice.app.anthropic_responses import _Blocks
from sluice.app.anthropic_responses import sse as anthropic_sse
from sluice.app.anthropic_schemas import ContentBlockDeltaEvent, TextDeltaBody
from sluice.app.prompts import Prompt
from sluice.app.responses import ChatBuilder, ChunkFrame, CompletionBuilder
from sluice.app.responses_api_builder import stream_event
from sluice.app.responses_api_schemas import ResponseObject, ResponseStreamEvent, TextConfig
from sluice.app.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCallDelta,
    PromptTokensDetails,
    TokenLogprobInfo,
    TopLogprob,
    ToolCallDelta,
    UsageInfo,
)
from sluice.app.streaming import DONE, sse_event
from sluice.app.tool_call_streams import CallStart, TextDelta
from sluice.app.tool_calls import ToolCalling
from sluice.batching.outputs import Increment, Usage

# Quotes, a backslash, non-ASCII text and a newline: whatever JSON must escape.
ID, MODEL = 'cmpl-"7"\\', "smöl\nlm"
CHAT_CHOICES = [
    [ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))],
    [ChatChunkChoice(index=1, delta=ChatDelta(content='é "quoted"\n\t</s>'))],
    [ChatChunkChoice(index=0, delta=ChatDelta(tool_calls=[ToolCallDelta(
        index=0, id="call_1", type="function", function=FunctionCallDelta(name="get_weather", arguments=""))]))],
    [ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="stop"),
     ChatChunkChoice(index=1, delta=ChatDelta(content="x"))],
    [],
]
COMPLETION_CHOICES = [
    [CompletionChoice(index=0, text=" hi")],
    [CompletionChoice(index=2, text="🙂", finish_reason="length",
                      logprobs=CompletionLogprobs(tokens=["🙂"], token_logprobs=[-0.25], top_logprobs=[{"🙂": -0.25}],
                                                  text_offset=[3]))],
]
USAGE = UsageInfo(prompt_tokens=5, completion_tokens=2, total_tokens=7,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))


TEXTS = ["Hi", ' "quoted" \\ back', "é\n\t\x01</s>", "🙂", "", "\u2028"]


def chat_text(index: int, text: str) -> ChatChunkChoice:
    return ChatChunkChoice(index=index, delta=ChatDelta(content=text))


def completion_text(index: int, text: str) -> CompletionChoice:
    return CompletionChoice(index=index, text=text)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(("empty", "cases", "text_choice"), [
    (ChatCompletionChunk(id=ID, created=1, model=MODEL, choices=[]), CHAT_CHOICES, chat_text),
    (CompletionResponse(id=ID, created=1, model=MODEL, choices=[]), COMPLETION_CHOICES, completion_text),
], ids=["chat", "completion"])
def test_each_chunk_is_the_event_of_the_whole_chunk(empty, cases, text_choice, include_usage: bool) -> None:
    frame = ChunkFrame(empty, include_usage, text_choice)
    exclude = None if include_usage else {"usage"}
    texts = [(index, text) for index in (0, 3, 0) for text in TEXTS]
    for choices in cases + [[text_choice(index, text)] for index, text in texts]:
        whole = empty.model_copy(update={"choices": choices})
        event = frame.event(choices)
        assert event == sse_event(whole.model_dump_json(exclude=exclude))
        assert ("usage" in json.loads(event[len(b"data: "):])) == include_usage
    for index, text in texts:
        assert frame.text_event(index, text) == frame.event([text_choice(index, text)])
    if include_usage:  # only then does a stream end with a usage chunk
        last = empty.model_copy(update={"usage": USAGE})
        assert json.loads(frame.whole_event(last)[len(b"data: "):])["usage"]["total_tokens"] == 7


def test_anthropic_text_deltas_framed_once_per_block_are_the_schemas_events():
    """`_Blocks` frames a text block's deltas once; each must be the whole event's bytes, in every block."""
    blocks, have, want = _Blocks(), [], []
    for block, piece in enumerate([*TEXTS, CallStart(0, "get_weather"), *TEXTS]):
        index = 0 if block < len(TEXTS) else 2  # a call closes the first text block; the text after opens a third
        events = blocks.add(TextDelta(piece) if isinstance(piece, str) else piece)
        have.append(events[-1])
        want.append(events[-1] if not isinstance(piece, str)
                    else anthropic_sse(ContentBlockDeltaEvent(index=index, delta=TextDeltaBody(text=piece))))
    assert have == want


def test_responses_api_events_serialized_without_their_model_are_the_models_events():
    response = ResponseObject(id="resp_x", created_at=0, status="in_progress", instructions='say "é"\n',
                              max_output_tokens=None, model=MODEL, output=[], parallel_tool_calls=True,
                              previous_response_id=None, temperature=1.0, top_p=1.0, tool_choice="auto", tools=[],
                              text=TextConfig(), store=True, metadata={"k": "v"})
    logprob = TokenLogprobInfo(token="é", logprob=-0.5, bytes=[195, 169],
                               top_logprobs=[TopLogprob(token="é", logprob=-0.5, bytes=[195, 169])])
    where = {"item_id": "msg_1", "output_index": 0}
    events = [
        {"type": "response.created", "response": response},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": "msg_1", "type": "message", "status": "in_progress", "content": []}},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": 'é "q"\\\n</s>',
         "logprobs": [logprob]},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": "🙂", "logprobs": []},
        {"type": "response.function_call_arguments.delta", **where, "delta": '{"city": "Z'},
    ]
    for number, event in enumerate(events):
        model = ResponseStreamEvent(**event, sequence_number=number).model_dump_json()
        assert stream_event(event, number) == f"event: {event['type']}\n".encode() + sse_event(model)


class _Replay:
    """A generation that replays increments (what a response builder reads)."""

    def __init__(self, increments: list[Increment]) -> None:
        self._increments = increments
        self.usage = Usage(prompt_tokens=2, completion_tokens=len(increments))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for increment in self._increments:
            yield increment


def test_a_completion_stream_sends_no_chunk_for_an_increment_without_text(smollm2):
    # A character's first bytes, or text held back as it may start a stop string, come with no text yet.
    body = CompletionRequest.model_validate({"prompt": "x", "stream": True})
    builder = CompletionBuilder("cmpl-1", MODEL, smollm2.tokenizer, body, [Prompt([1], "x")])
    replay = _Replay([Increment(0, "", (5,)), Increment(0, "Hi", (6,)), Increment(0, "", (7,), finish_reason="stop")])

    async def texts() -> list[str]:
        events = [event async for event in builder.events(replay)]
        return [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events if b"choices" in e]

    assert asyncio.run(texts()) == ["Hi", ""]  # the text, then the finish


class _Broken(_Replay):
    """A generation whose reading fails after its increments, as a bug would (not an engine error)."""

    async def increments(self) -> AsyncGenerator[Increment, None]:
        async for increment in super().increments():
            yield increment
        raise RuntimeError("a bug")


def test_a_bug_mid_stream_ends_the_stream_with_an_error_event_and_done(smollm2):
    body = CompletionRequest.model_validate({"prompt": "x", "stream": True})
    builder = CompletionBuilder("cmpl-1", MODEL, smollm2.tokenizer, body, [Prompt([1], "x")])

    async def events() -> list[bytes]:
        return [event async for event in builder.events(_Broken([Increment(0, "Hi", (6,))]))]

    *_, error, done = asyncio.run(events())
    assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "server_error" and done == DONE


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool calls"])
def test_a_chat_stream_with_return_token_ids_sends_every_increments_ids_once_and_the_prompts_first(smollm2, tools):
    """Each increment's ids ride on its first chunk (or a chunk of their own, when its text is held back or a call
    has not parsed yet); the prompt's ride on the stream's first chunk only."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                 "return_token_ids": True})
    calling = ToolCalling(frozenset({"get_weather"})) if tools else None
    builder = ChatBuilder("chatcmpl-1", MODEL, smollm2.tokenizer, body, [1, 2, 3], calling)
    pieces = ["Hi ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {}}', "</tool_call>", ""]
    replay = _Replay([Increment(0, text, (10 + i, 20 + i), finish_reason="stop" if i == len(pieces) - 1 else None)
                      for i, text in enumerate(pieces)])

    async def chunks() -> list[dict]:
        return [json.loads(e.removeprefix(b"data: ")) for e in [e async for e in builder.events(replay)] if e != DONE]

    chunks = asyncio.run(chunks())
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3] and not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == [t for i in range(6)
                                                                                 for t in (10 + i, 20 + i)]
