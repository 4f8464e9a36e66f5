"""A stream's SSE chunks, serialized around their choices once per stream (`ChunkFrame`), are byte for byte the
events of the whole chunks."""

from __future__ import annotations

import json

import pytest

from sluice.app.responses import ChunkFrame
from sluice.app.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCallDelta,
    UsageInfo,
)
from sluice.app.streaming import sse_event

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


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(("empty", "cases"), [
    (ChatCompletionChunk(id=ID, created=1, model=MODEL, choices=[]), CHAT_CHOICES),
    (CompletionResponse(id=ID, created=1, model=MODEL, choices=[]), COMPLETION_CHOICES),
], ids=["chat", "completion"])
def test_each_chunk_is_the_event_of_the_whole_chunk(empty, cases, include_usage: bool) -> None:
    frame = ChunkFrame(empty, include_usage)
    exclude = None if include_usage else {"usage"}
    for choices in cases:
        whole = empty.model_copy(update={"choices": choices})
        event = frame.event(choices)
        assert event == sse_event(whole.model_dump_json(exclude=exclude))
        assert ("usage" in json.loads(event[len(b"data: "):])) == include_usage
    if include_usage:  # only then does a stream end with a usage chunk
        last = empty.model_copy(update={"usage": USAGE})
        assert json.loads(frame.usage_event(last)[len(b"data: "):])["usage"]["total_tokens"] == 7
