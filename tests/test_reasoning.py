"""A reasoning model's thinking told from its answer (`--reasoning-parser`): the split of a whole reply and of
one streamed in pieces agree, and each API shows the reasoning where its clients read it."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncGenerator

import httpx
import openai
import pytest

from sluice.app.reasoning import ReasoningFormat, Thought
from sluice.app.responses import ChatBuilder
from sluice.app.schemas import ChatCompletionRequest
from sluice.app.tool_call_streams import TextDelta
from sluice.app.tool_calls import ToolCalling
from sluice.batching.outputs import Increment, Usage
from sluice.model.config import ModelConfig

from hf_folder import write_hf_folder
from test_api_e2e import API_KEY, start_server

DEEPSEEK, QWEN3 = ReasoningFormat.named("deepseek_r1"), ReasoningFormat.named("qwen3")
REPLIES = ["<think>\nweigh it\n</think>\n\nNine.", "weigh it</think>Nine.", "Nine.", "<think>cut short",
           "  <thi", "</think>", "<think></think>  x", "a </thi", "a</think", "<think>a<think>b</think>c</think>d"]


@pytest.mark.parametrize(("format", "reply", "split"), [
    (DEEPSEEK, "<think>\nweigh it\n</think>\n\nNine.", ("\nweigh it\n", "Nine.")),
    (DEEPSEEK, "weigh it</think>Nine.", ("weigh it", "Nine.")),  # the template opened <think>
    (DEEPSEEK, "cut short", ("cut short", "")),  # it ran out of tokens while thinking
    (DEEPSEEK, "<think></think>  x", (None, "x")),
    (QWEN3, "<think>\nweigh it\n</think>\n\nNine.", ("\nweigh it\n", "Nine.")),
    (QWEN3, "Nine.", (None, "Nine.")),  # thinking disabled: no tags
    (QWEN3, "weigh it</think>Nine.", (None, "weigh it</think>Nine.")),
    (QWEN3, "<think>cut short", ("cut short", "")),
    (QWEN3, "    return x\n", (None, "    return x\n")),  # a reply that does not think is as written
    # Under a grammar (JSON, forced calls) a reply starts inside no reasoning the template opened.
    (ReasoningFormat.named("deepseek_r1", under_grammar=True), '{"a": 1}', (None, '{"a": 1}')),
    (ReasoningFormat.named("deepseek_r1", under_grammar=True), "<think>hm</think>{}", ("hm", "{}")),
], ids=lambda value: value.name if isinstance(value, ReasoningFormat) else None)
def test_a_whole_reply_splits_into_its_reasoning_and_its_answer(format, reply, split):
    assert format.split(reply) == split


@pytest.mark.parametrize("format", [DEEPSEEK, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_a_reply_streamed_in_any_pieces_splits_as_the_whole_reply(format):
    rng = random.Random(0)
    for reply in REPLIES:
        for _ in range(40):
            stream, pieces, at = format.stream(), [], 0
            while at < len(reply):
                step = rng.randrange(1, 5)
                pieces += stream.push(reply[at:at + step])
                at += step
            pieces += stream.finish()
            reasoning = "".join(piece.text for piece in pieces if isinstance(piece, Thought)) or None
            assert (reasoning, "".join(p.text for p in pieces if isinstance(p, TextDelta))) == format.split(reply)


class _Replay:
    """A generation that replays one choice's text in pieces (what a response builder reads)."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = pieces
        self.usage = Usage(prompt_tokens=2, completion_tokens=len(pieces))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for i, piece in enumerate(self._pieces):
            yield Increment(0, piece, (i,), finish_reason="stop" if i == len(self._pieces) - 1 else None)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool calls"])
def test_a_chat_reply_streamed_and_whole_has_its_reasoning_apart_and_its_answer_read_for_calls(smollm2, tools):
    pieces = ["<th", "ink>Which", " tool?</th", "ink>\n\n", "<tool_call>", '{"name": "get_weather", "arguments": ',
              '{"city": "Oslo"}}', "</tool_call>"] if tools else ["<th", "ink>Sum", " it.</think>", "\n", "Nine", "."]
    calling = ToolCalling(frozenset({"get_weather"})) if tools else None

    def builder(stream: bool) -> ChatBuilder:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": stream})
        return ChatBuilder("chatcmpl-1", "m", smollm2.tokenizer, body, [1], calling, QWEN3)

    async def streamed() -> list[dict]:
        events = [event async for event in builder(True).events(_Replay(pieces))]
        return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]

    whole = asyncio.run(builder(False).collect(_Replay(pieces))).model_dump()["choices"][0]
    deltas = [chunk["choices"][0]["delta"] for chunk in asyncio.run(streamed())]
    reasoning = "Which tool?" if tools else "Sum it."
    assert whole["message"]["reasoning"] == whole["message"]["reasoning_content"] == reasoning
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    if tools:
        assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
        assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
        assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d) == \
            '{"city": "Oslo"}'
    else:
        assert whole["message"]["content"] == "".join(d.get("content", "") for d in deltas) == "Nine."


# --- served -----------------------------------------------------------------------------------------------------

MODEL = "tiny-thinking"
FLAGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--kv-cache-memory",
         "8MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui", "--reasoning-parser", "qwen3"]
# The tiny random model thinks only where a grammar makes it (the grammar holds the whole reply, thinking too).
THINKING = {"structured_outputs": {"regex": "<think>[a-z]{2,8}</think>\n[a-z]{2,8}"}, "temperature": 0}
PLAIN = {"structured_outputs": {"regex": "[a-z]{2,8}"}, "temperature": 0}


# ChatML that shows what a reasoning model's template reads: an assistant's reasoning, the effort asked for and
# whether to think.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m['content'] }}</s>\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined %}thinking: {{ enable_thinking }}\n{% endif %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
HELLO = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=1024), seed=7,
                    chat_template=TEMPLATE)
    proc = start_server("--model", str(folder), *FLAGS, env={"SLUICE_HOME": str(tmp_path_factory.mktemp("home"))})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_served_chat_gives_the_reasoning_apart_whole_and_streamed_and_none_for_a_reply_that_does_not_think(client):
    messages = HELLO
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, extra_body=THINKING)
    message = reply.choices[0].message
    thought, answer = message.model_extra["reasoning"], message.content
    assert message.model_extra["reasoning_content"] == thought and thought.isalpha() and answer.isalpha()
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True,
                                                 extra_body=THINKING))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, extra_body=PLAIN)
    assert plain.choices[0].message.content.isalpha() and "reasoning" not in plain.choices[0].message.model_extra


def rendered(server, messages: list[dict], **fields) -> tuple[str, int]:
    """The prompt /tokenize renders for the messages and chat fields (its text, through /detokenize) and its
    length."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **fields}, headers=headers,
                        timeout=60).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, headers=headers, timeout=60).json()["prompt"]
    return text, len(tokens)


@pytest.mark.parametrize(("fields", "shown"), [
    ({"reasoning_effort": "high"}, "effort: high\nthinking: True\n"),
    ({"reasoning_effort": "none"}, "effort: none\nthinking: False\n"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "effort: low\nthinking: False\n"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "effort: low\nthinking: True\n"),
    ({}, "fox\nassistant\n"),  # special tokens (<s>, </s>) have no text
], ids=["high", "none", "thinking set", "kwargs effort replaced", "not set"])
def test_chats_reasoning_effort_reaches_the_template_with_enable_thinking_as_vllm_passes_them(server, client, fields,
                                                                                              shown):
    text, length = rendered(server, HELLO, **fields)
    assert shown in text and ("effort" in text) == bool(fields)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, extra_body=fields)
    assert reply.usage.prompt_tokens == length
