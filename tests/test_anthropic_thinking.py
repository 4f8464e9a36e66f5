"""Anthropic's Messages API under a --reasoning-parser: the reply's reasoning is a `thinking` block, and the usage's
`output_tokens_details.thinking_tokens` (the anthropic client's) counts the tokens it was generated in, those of
chat's `reasoning_tokens` and the Responses API's (vLLM's count), and the tags' own that the reply generated: the
anthropic client documents the field as "including the thinking-block delimiter tokens"."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from sluice.app.anthropic_responses import MessageBuilder
from sluice.app.reasoning import ReasoningFormat
from sluice.model.tokenizer import Tokenizer

from test_api_e2e import API_KEY, start_server
from test_reasoning_tokens import CUT, DEEPSEEK, QWEN3, THINKING, THOUGHT, Replay, text_encoded_again

MODEL = "smollm2-thinking"
FLAGS = ["--skip-server-warmup", "--max-num-seqs", "2", "--max-num-batched-tokens", "128", "--max-model-len", "512",
         "--kv-cache-memory", "32MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui"]
HELLO = [{"role": "user", "content": "What is 2+2?"}]


def builder(tokenizer: Tokenizer, reasoning: ReasoningFormat | None) -> MessageBuilder:
    return MessageBuilder("msg_1", MODEL, 1, None, reasoning, tokenizer=tokenizer)


def streamed_usage(events: list[bytes]) -> dict:
    """The usage of a stream's `message_delta` (which the client's final message takes)."""
    data = [json.loads(event.split(b"data: ", 1)[1]) for event in events]
    return next(event for event in data if event["type"] == "message_delta")["usage"]


@pytest.mark.parametrize(("pieces", "finish", "generated"), [(THINKING, "stop", 3 + len(THOUGHT) + 3),
                                                        (CUT, "length", 3 + 5)],
                         ids=["thought-and-answer", "cut-short"])
@pytest.mark.parametrize("step", [1, 4], ids=["a-token-an-increment", "four-tokens-an-increment"])
def test_a_messages_thinking_tokens_are_those_its_reasoning_and_its_tags_were_generated_in(smollm2, pieces, finish,
                                                                                             generated, step):
    """`<think>` and `</think>` are three tokens each in SmolLM2's vocabulary."""
    tokenizer = smollm2.tokenizer
    assert text_encoded_again(tokenizer, pieces) != generated

    async def events() -> list[bytes]:
        return [event async for event in builder(tokenizer, QWEN3).events(Replay(tokenizer, [(pieces, finish)], step))]

    whole = asyncio.run(builder(tokenizer, QWEN3).collect(Replay(tokenizer, [(pieces, finish)], step)))
    assert whole.model_dump()["usage"]["output_tokens_details"] == {"thinking_tokens": generated}
    assert streamed_usage(asyncio.run(events()))["output_tokens_details"] == {"thinking_tokens": generated}


def test_without_a_reasoning_parser_the_usage_has_no_output_tokens_details(smollm2):
    """As chat's completion_tokens_details: no parser, nothing told apart as reasoning."""
    tokenizer = smollm2.tokenizer

    async def events() -> list[bytes]:
        return [event async for event in builder(tokenizer, None).events(Replay(tokenizer, [(THINKING, "stop")], 1))]

    whole = asyncio.run(builder(tokenizer, None).collect(Replay(tokenizer, [(THINKING, "stop")], 1)))
    assert "output_tokens_details" not in json.loads(whole.model_dump_json())["usage"]
    assert "output_tokens_details" not in streamed_usage(asyncio.run(events()))


@pytest.fixture(scope="module")
def server():
    """SmolLM2 read as DeepSeek-R1 is: its replies start inside their reasoning (the template would have opened
    it), so a reply is reasoning up to a `</think>` it may never write."""
    proc = start_server(*FLAGS, "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


def test_a_served_messages_thinking_is_a_block_whose_tokens_the_usage_counts_as_chat_does_with_the_tags(server,
                                                                                                      smollm2):
    kwargs = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body={"temperature": 0})
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as chat_client:
        chat = chat_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                                   extra_body={"return_token_ids": True})
    assert whole.content[0].type == "thinking" and whole.content[0].signature
    assert [block.to_dict() for block in streamed.content] == [block.to_dict() for block in whole.content]
    thinking = whole.usage.output_tokens_details.thinking_tokens
    reasoning = chat.usage.completion_tokens_details.reasoning_tokens
    with_tags = DEEPSEEK.count_tokens(smollm2.tokenizer, chat.choices[0].token_ids, tags=True)
    assert 0 < reasoning <= thinking == with_tags <= whole.usage.output_tokens
    assert (streamed.usage.output_tokens, streamed.usage.output_tokens_details) == (
        whole.usage.output_tokens, whole.usage.output_tokens_details)
