"""The usage's reasoning tokens (chat's `completion_tokens_details`, the Responses API's `output_tokens_details`) are
the tokens the reasoning was generated in, as vLLM's reasoning parsers count them (`count_reasoning_tokens`): not
its text encoded again, which a small model's reply often is not (SmolLM2 may write "Hmm" as "H", "m", "m", which
encodes again as "H", "mm"), and not the tags' own tokens. Anthropic's `thinking_tokens` are the same tokens and the
tags' the reply generated, as Anthropic counts its thinking block's delimiters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from sluice.app.reasoning import END, START, ReasoningFormat
from sluice.app.responses import ChatBuilder
from sluice.app.responses_api_builder import ResponsesBuilder
from sluice.app.responses_api_schemas import ResponseObject
from sluice.app.schemas import ChatCompletionRequest
from sluice.batching.outputs import Increment, Usage
from sluice.model.tokenizer import Tokenizer

from test_reasoning import one_token_tags
from test_responses_api import blank_response

DEEPSEEK, QWEN3 = ReasoningFormat.named("deepseek_r1"), ReasoningFormat.named("qwen3")

# SmolLM2's vocabulary has no tag tokens: it writes `<think>` as "<", "think", ">" and `</think>` as "</", "think",
# ">" (" </" after a space).
OPEN, CLOSE = ["<", "think", ">"], ["</", "think", ">"]
THOUGHT = ["H", "m", "m", ",", " we", "igh", " it", "."]  # "Hmm, weigh it.": encoded again, 6 tokens
ANSWER = ["\n\n", "N", "ine", ".", "<|im_end|>"]
THINKING = [*OPEN, *THOUGHT, *CLOSE, *ANSWER]
CUT = [*OPEN, *THOUGHT[:5]]  # max_tokens cut the thought short: "Hmm, we", encoded again 4 tokens


def ids_of(tokenizer: Tokenizer, pieces: list[str]) -> list[int]:
    """The token of each piece of text (each one token of the vocabulary)."""
    ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]
    assert all(len(one) == 1 for one in ids), pieces
    return [one for [one] in ids]


@pytest.mark.parametrize(("format", "pieces", "reasoning", "thinking"), [
    (QWEN3, THINKING, len(THOUGHT), 3 + len(THOUGHT) + 3),
    (QWEN3, CUT, 5, 3 + 5),  # every token after the opening
    (DEEPSEEK, [*THOUGHT, *CLOSE, *ANSWER], len(THOUGHT), len(THOUGHT) + 3),  # the template opened the thought
    (DEEPSEEK, THINKING, len(THOUGHT), 3 + len(THOUGHT) + 3),  # a <think> of its own is no reasoning
    (DEEPSEEK, ["N", "ine", "."], 3, 3),  # all of it is reasoning, cut short
    (QWEN3, ["N", "ine", "."], 0, 0),  # a reply that does not think
    (QWEN3, ["\n", *OPEN, "H", " </", "think", ">", "N"], 2, 7),  # " </" holds the thought's last character
    (QWEN3, ["<", "think", "></", "think", ">", "N"], 0, 5),  # empty: one token ends a tag and opens the other
], ids=["thought-and-answer", "cut-short", "opened-by-the-template", "deepseek-r1-opening-its-own", "deepseek-r1-cut",
        "no-thought", "tag-after-a-space", "empty-thought"])
def test_a_replys_reasoning_tokens_are_those_holding_its_reasoning_where_the_tags_are_text(smollm2, format, pieces,
                                                                                           reasoning, thinking):
    """Its thinking tokens (Anthropic's) are those holding the tags' text too."""
    ids = ids_of(smollm2.tokenizer, pieces)
    assert format.count_tokens(smollm2.tokenizer, ids) == reasoning
    assert format.count_tokens(smollm2.tokenizer, ids, tags=True) == thinking


@pytest.mark.parametrize("special", [False, True], ids=["added tags", "special tags"])
@pytest.mark.parametrize(("format", "pieces", "reasoning", "thinking"), [
    (QWEN3, [START, "a", "b", "c", END, "\n", "x"], 3, 5),
    (QWEN3, [" ", START, "a", END, "x"], 1, 3),  # whitespace before the opening
    (QWEN3, [START, "a", "b"], 2, 3),  # cut short
    (QWEN3, ["a", END, "x"], 0, 0),
    (DEEPSEEK, ["a", "b", END, "x"], 2, 3),  # the template opened the thought
    (DEEPSEEK, [START, "a", END, "x"], 1, 3),
    (DEEPSEEK, ["a", "b"], 2, 2),
], ids=["thought", "blank-first", "cut-short", "no-thought", "opened-by-the-template", "deepseek-r1-opening-its-own",
        "deepseek-r1-cut"])
def test_a_replys_reasoning_tokens_are_those_between_its_tags_where_each_tag_is_a_token(special, format, pieces,
                                                                                        reasoning, thinking):
    """Its thinking tokens (Anthropic's) are those and the tags' the reply generated."""
    tokenizer = one_token_tags(special)
    ids = ids_of(tokenizer, pieces)
    assert format.count_tokens(tokenizer, ids) == reasoning
    assert format.count_tokens(tokenizer, ids, tags=True) == thinking


class Replay:
    """A generation replaying each choice's tokens (`replies`: the pieces of text of its tokens, and its finish
    reason), `step` tokens an increment, the choices in turn."""

    def __init__(self, tokenizer: Tokenizer, replies: list[tuple[list[str], str]], step: int) -> None:
        self._replies = [(ids_of(tokenizer, pieces), finish) for pieces, finish in replies]
        self._tokenizer = tokenizer
        self._step = step
        self.usage = Usage(prompt_tokens=1, completion_tokens=sum(len(ids) for ids, _ in self._replies))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        longest = max(len(ids) for ids, _ in self._replies)
        for at in range(0, longest, self._step):
            for choice, (ids, finish) in enumerate(self._replies):
                taken = ids[at:at + self._step]
                if taken:
                    yield Increment(choice, self._tokenizer.decode(taken), tuple(taken),
                                    finish_reason=finish if at + self._step >= len(ids) else None)


REPLIES = [(THINKING, "stop"), (CUT, "length")]  # a chat's two choices (n=2)


def text_encoded_again(tokenizer: Tokenizer, pieces: list[str]) -> int:
    """How many tokens the reply's reasoning text encodes to: what the usage counted before."""
    reasoning, _ = QWEN3.split("".join(pieces))
    return len(tokenizer.encode(reasoning, add_special_tokens=False))


@pytest.mark.parametrize("step", [1, 4], ids=["a-token-an-increment", "four-tokens-an-increment"])
def test_a_chat_replys_reasoning_tokens_are_those_its_choices_reasoning_was_generated_in(smollm2, step):
    tokenizer = smollm2.tokenizer
    generated = len(THOUGHT) + 5
    assert sum(text_encoded_again(tokenizer, pieces) for pieces, _ in REPLIES) != generated

    def builder(stream: bool) -> ChatBuilder:
        body = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})})
        return ChatBuilder("chatcmpl-1", "m", tokenizer, body, [1], None, QWEN3)

    async def streamed() -> dict:
        events = [event async for event in builder(True).events(Replay(tokenizer, REPLIES, step))]
        return json.loads(events[-2].removeprefix(b"data: "))["usage"]  # the last chunk's, before [DONE]

    whole = asyncio.run(builder(False).collect(Replay(tokenizer, REPLIES, step)))
    assert whole.usage.completion_tokens_details.reasoning_tokens == generated
    assert asyncio.run(streamed())["completion_tokens_details"] == {"reasoning_tokens": generated}


@pytest.mark.parametrize(("pieces", "finish", "generated"), [(THINKING, "stop", len(THOUGHT)), (CUT, "length", 5)],
                         ids=["thought-and-answer", "cut-short"])
@pytest.mark.parametrize("step", [1, 4], ids=["a-token-an-increment", "four-tokens-an-increment"])
def test_a_responses_replys_reasoning_tokens_are_those_its_reasoning_was_generated_in(smollm2, pieces, finish,
                                                                                      generated, step):
    tokenizer = smollm2.tokenizer
    assert text_encoded_again(tokenizer, pieces) != generated

    def builder() -> ResponsesBuilder:
        return ResponsesBuilder(blank_response(), None, lambda _: None, reasoning=QWEN3, tokenizer=tokenizer)

    async def streamed() -> ResponseObject:
        events = [event async for event in builder().events(Replay(tokenizer, [(pieces, finish)], step))]
        return ResponseObject.model_validate(json.loads(events[-1].split(b"data: ", 1)[1])["response"])

    whole = asyncio.run(builder().collect(Replay(tokenizer, [(pieces, finish)], step)))
    for response in (whole, asyncio.run(streamed())):
        assert response.usage.output_tokens_details.reasoning_tokens == generated
