"""A reasoning model's thinking told from its answer (`--reasoning-parser`): the split of a whole reply and of
one streamed in pieces agree, and each API shows the reasoning where its clients read it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import AsyncGenerator

import anthropic
import httpx
import httpx2
import numpy as np
import openai
import pytest
from flax import nnx
from pydantic import BaseModel
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from sluice.app.anthropic_responses import MessageBuilder
from sluice.app.reasoning import ANY_ANSWER, END, START, ReasoningFormat, Thought, think_token_ids
from sluice.app.responses import ChatBuilder
from sluice.app.responses_api_builder import ResponsesBuilder
from sluice.app.responses_api_convert import chat_messages, output_items, stored_items
from sluice.app.responses_api_schemas import ResponseObject
from sluice.app.routes import plan_chat
from sluice.app.schemas import ChatCompletionRequest, TokenLogprobInfo
from sluice.app.state import ServerSettings, ServerState
from sluice.app.tool_call_streams import TextDelta
from sluice.app.tool_calls import ToolCalling, call_grammar
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Increment, TokenLogprob, Usage
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.batching.structured import GrammarCompiler, fill_bitmask
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from sluice.model.tokenizer import SpecialTokens, Tokenizer

from hf_folder import train_tokenizer, write_hf_folder
from test_api_e2e import API_KEY, start_server
from test_responses_api import ScriptedGeneration, blank_response
from test_tool_calls import ADD, call

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


# --- the grammar after the reasoning ----------------------------------------------------------------------------

# A structured output of each kind, an answer it takes and one it refuses.
ANSWERS = {
    "json_schema": (StructuredOutput("json_schema", json.dumps(ADD[1])), '{"a": 1}', '{"a": "1"}'),
    "regex": (StructuredOutput("regex", "[a-z]{2,8}"), "fox", "Fox"),
    "choice": (StructuredOutput("choice", '["yes", "no"]'), "no", "nope"),
    "lark": (StructuredOutput("grammar", 'start: "x=" NUMBER\nNUMBER: /[0-9]+/'), "x=12", "x=a"),
    "gbnf": (StructuredOutput("grammar", 'root ::= "yes" | "no"'), "yes", "yes!"),
    "forced call": (call_grammar([ADD], parallel=False), call("add", '{"a": 1}'), call("add", '{"a": "1"}')),
}


@pytest.mark.parametrize("special", [True, False], ids=["special tags", "one-token text tags"])
def test_the_calls_a_model_chooses_are_held_after_reasoning_that_may_write_their_tag(special):
    """tool_choice auto with strict tools: the thought is free (a `<tool_call>` in it included), the answer free
    text until it opens a call, which then follows its schema. Where the tags are one token each, special or not
    (Qwen3's are not); spelled in pieces, a qwen3 reply's thought that writes `<tool_call>` would be read as the
    answer's call."""
    backend = train_tokenizer(286)
    backend.add_tokens([AddedToken(tag, special=special, normalized=False) for tag in (START, END)])
    tokenizer = Tokenizer(backend, SpecialTokens(1, (2,), False, None))
    answer = call_grammar([ADD], parallel=False, after_text=True)
    thought = "<think>\nmaybe <tool_call> {a: one}</think>\n\n"
    for format in (DEEPSEEK, QWEN3):
        tags = (tokenizer, GrammarCompiler(tokenizer, 288, (2,)))
        assert takes(tags, format, answer, thought + "Sure. " + call("add", '{"a": 1}')) == (True, True)
        assert takes(tags, format, answer, thought + "Just text.") == (True, True)
        assert takes(tags, format, answer, thought + call("add", '{"a": "1"}'))[0] is False


def tag_vocabulary(special: bool) -> HFTokenizer:
    """A byte-level vocabulary of 288 tokens, whose last two are `<think>` and `</think>` if `special`."""
    backend = train_tokenizer(286 if special else 288)
    if special:
        backend.add_special_tokens([AddedToken(tag, special=True, normalized=False) for tag in (START, END)])
    return backend


def think_tokenizer(special: bool) -> Tokenizer:
    return Tokenizer(tag_vocabulary(special), SpecialTokens(1, (2,), False, None))


@pytest.fixture(scope="module", params=[False, True], ids=["text tags", "special tags"])
def tags(request) -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = think_tokenizer(request.param)
    return tokenizer, GrammarCompiler(tokenizer, 288, (2,))


def takes(tags: tuple[Tokenizer, GrammarCompiler], format: ReasoningFormat, answer: StructuredOutput,
          reply: str) -> tuple[bool, bool]:
    """Whether the grammar `answer` after `format`'s reasoning takes `reply`, token by token, and whether it is then
    complete."""
    tokenizer, compiler = tags
    matcher = compiler.compile(dataclasses.replace(answer, preamble=format.preamble(tokenizer))).matcher
    taken = all(matcher.consume_token(t) for t in tokenizer.encode(reply, add_special_tokens=False))
    return taken, taken and matcher.is_accepting()


@pytest.mark.parametrize("kind", ANSWERS)
def test_the_grammar_holds_the_answer_after_reasoning_that_is_free(tags, kind):
    answer, good, bad = ANSWERS[kind]
    for format in (DEEPSEEK, QWEN3):
        assert takes(tags, format, answer, f"<think>\nweigh it, {{ or }} </thin\n</think>\n\n{good}") == (True, True)
        assert takes(tags, format, answer, f"<think>hm</think>{bad}")[1] is False
        assert takes(tags, format, answer, "<think>cut short by max_tok") == (True, False)
    assert takes(tags, DEEPSEEK, answer, f"the template opened it</think>\n\n{good}") == (True, True)
    assert takes(tags, DEEPSEEK, answer, good)[1] is False  # the answer comes after </think>
    assert takes(tags, QWEN3, answer, good) == (True, True)  # a reply that does not think
    assert takes(tags, QWEN3, answer, f"hm</think>{good}")[0] is False


def test_where_the_tags_are_special_tokens_the_reasoning_writes_no_tag_as_text_for_the_reader_to_split_at():
    tokenizer = think_tokenizer(special=True)
    spec = dataclasses.replace(ANSWERS["regex"][0], preamble=DEEPSEEK.preamble(tokenizer))
    matcher = GrammarCompiler(tokenizer, 288, (2,)).compile(spec).matcher
    text_tag = [t for piece in ("hm</thi", "nk>") for t in tokenizer.encode(piece, add_special_tokens=False)]
    assert tokenizer.special_token_id(END) not in text_tag
    assert not all(matcher.consume_token(t) for t in text_tag)


def one_token_tags(special: bool) -> Tokenizer:
    """A byte-level vocabulary of 288 tokens whose last two are the tags, special (DeepSeek-R1's) or not (Qwen3's,
    whose tags decode to their text)."""
    backend = train_tokenizer(286)
    tags = [AddedToken(tag, special=special, normalized=False) for tag in (START, END)]
    backend.add_special_tokens(tags) if special else backend.add_tokens(tags)
    return Tokenizer(backend, SpecialTokens(1, (2,), False, None))


@pytest.mark.parametrize("special", [False, True], ids=["added tags", "special tags"])
def test_only_special_tags_and_no_other_special_token_keep_their_text_for_the_reader(special):
    """The request kept every special token's text where the tags were special; now their own text alone."""
    tokenizer = one_token_tags(special)
    tags = frozenset(tokenizer.encode(START + END, add_special_tokens=False))
    assert think_token_ids(tokenizer) == (tags if special else frozenset())
    stream = tokenizer.decode_stream(skip_special_tokens=True, kept_special_ids=think_token_ids(tokenizer))
    ids = [*tokenizer.encode("<think>hm</think>ok", add_special_tokens=False), 1]  # 1: BOS, another special token
    assert stream.push(ids) + stream.flush() == "<think>hm</think>ok"


@pytest.mark.parametrize("special", [False, True], ids=["added tags", "special tags"])
@pytest.mark.parametrize("format", [DEEPSEEK, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("budget", [0, 1, 7])
def test_a_thinking_budget_forces_the_end_of_the_thought_after_that_many_tokens(special, format, budget):
    tokenizer = one_token_tags(special)
    compiler = GrammarCompiler(tokenizer, 288, (2,))
    (opening,), (closing,) = (tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END))
    thought = tokenizer.encode("weigh it, and weigh it again", add_special_tokens=False)
    for answer in (ANY_ANSWER, ANSWERS["lark"][0]):  # the lark answer takes "x=12"
        preamble = format.preamble(tokenizer, budget, eos_token_ids=(2,))
        matcher = compiler.compile(dataclasses.replace(answer, preamble=preamble)).matcher
        assert matcher.consume_token(opening) and all(matcher.consume_token(t) for t in thought[:budget])
        assert not matcher.deep_copy().consume_token(2)  # it cannot end while it thinks
        probe = matcher.deep_copy()
        assert not probe.consume_token(thought[budget])  # past the budget, only </think> is left
        assert matcher.consume_token(closing)
        taken = all(matcher.consume_token(t) for t in tokenizer.encode("\n\nx=12", add_special_tokens=False))
        assert taken and matcher.is_accepting()
    free = compiler.compile(dataclasses.replace(ANY_ANSWER, preamble=format.preamble(tokenizer)))
    assert all(free.matcher.consume_token(t) for t in [opening, *thought, closing])  # no budget: as long as it likes


@pytest.mark.parametrize("format", [DEEPSEEK, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_a_thinking_budget_holds_for_speculative_drafts_checked_and_rolled_back(format):
    """The engine cuts n-gram drafts to what the grammar allows (`valid_prefix`) and fills a mask after each one,
    rolling the matcher back (`fill_bitmask`): drafts past the budget are cut, and the matcher goes on after."""
    tokenizer = one_token_tags(special=True)
    (opening,), (closing,) = (tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END))
    thought = tokenizer.encode("weigh it, and weigh it again", add_special_tokens=False)
    spec = dataclasses.replace(ANY_ANSWER, preamble=format.preamble(tokenizer, 3, eos_token_ids=(2,)))
    grammar = GrammarCompiler(tokenizer, 288, (2,)).compile(spec)
    grammar.advance(opening)
    assert grammar.valid_prefix(thought) == thought[:3]
    masks = np.zeros((4, 9), np.int32)
    fill_bitmask([(grammar, 0, thought[:3])], masks)
    assert np.flatnonzero(np.unpackbits(masks[3].view(np.uint8), bitorder="little")).tolist() == [closing]
    for token in [*thought[:3], closing, *thought]:
        grammar.advance(token)


def test_drafts_end_before_an_eos_which_a_reply_that_ignores_eos_goes_on_past():
    """A matcher that took EOS allows nothing but EOS after it, while a reply that ignores EOS goes on past one with
    its grammar where it was: a draft after an EOS would be checked under a mask that reply does not keep."""
    grammar = GrammarCompiler(one_token_tags(special=True), 288, (2,)).compile(ANY_ANSWER)
    assert grammar.valid_prefix([50, 51, 2, 52]) == [50, 51]


@pytest.fixture(scope="module")
def thinking_engine() -> Engine:
    """A tiny random model over the 288-token vocabulary whose tags are special tokens; EOS is 2."""
    config = ModelConfig.tiny(vocab_size=288)
    loaded = LoadedModel(config, Llama(config, rngs=nnx.Rngs(0)), one_token_tags(special=True), "tiny")
    return Engine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=4,
                                       kv_cache_memory=4 << 20, warmup=False), progress=False)


@pytest.mark.parametrize(("fields", "finish", "num_tokens"), [
    ({}, "stop", None), ({"ignore_eos": True}, "length", 12), ({"min_tokens": 6}, "stop", 7),
], ids=["at eos", "ignore_eos", "min_tokens"])
def test_the_answer_after_a_thinking_budget_ends_at_eos_as_a_reply_without_one(thinking_engine, fields, finish,
                                                                                num_tokens):
    """The answer after a budget's thought is free (`ANY_ANSWER`): the tiny model, biased to EOS, writes it as soon
    as the thought is over, and EOS ends the reply there, or not before min_tokens, or (ignore_eos) not at all, as
    it does a reply without a budget (which writes it from the start)."""
    tokenizer = thinking_engine.tokenizer
    closing = tokenizer.special_token_id(END)
    budget = dataclasses.replace(ANY_ANSWER, preamble=DEEPSEEK.preamble(tokenizer, 2, eos_token_ids=(2,)))
    free = SamplingParams(temperature=0.0, max_tokens=12, logit_bias=((2, 100.0),), **fields)
    without, within = (choices[0] for choices in thinking_engine.generate(
        [[5, 6, 7, 8]] * 2, [free, dataclasses.replace(free, structured=budget)]))
    assert closing in within.token_ids[:4]  # a <think> of its own, a thought of two tokens, </think>
    for reply in (without, within):
        assert reply.finish_reason == finish and reply.token_ids[-1] == 2
        assert num_tokens is None or len(reply.token_ids) == num_tokens
        assert finish == "length" or reply.token_ids.index(2) == len(reply.token_ids) - 1


def test_a_chats_thought_under_a_grammar_is_decoded_in_multi_step_calls():
    """The thinking before a grammar's answer leaves the text free, EOS aside: a multi-step engine draws it without
    the mask, several tokens a call. The answer's grammar keeps its own mark (a JSON answer's forced tokens are
    appended at once, its batch collected first). (The tiny model, biased to write "a", thinks in whole
    characters: its favourite byte tokens are no text.)"""
    config = ModelConfig.tiny(vocab_size=288)
    tokenizer = one_token_tags(special=True).with_chat_template(TEMPLATE)
    engine = Engine(LoadedModel(config, Llama(config, rngs=nnx.Rngs(0)), tokenizer, "tiny"),
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, page_size=4,
                                 kv_cache_memory=4 << 20, warmup=False, num_decode_steps=4), progress=False)
    [a] = tokenizer.encode("a", add_special_tokens=False)
    state = ServerState(ServerSettings(reasoning_parser="deepseek_r1"))
    body = ChatCompletionRequest(model="tiny", messages=HELLO, max_tokens=24, temperature=0,
                                 structured_outputs={"regex": "[a-z]{2,8}"},
                                 logit_bias={str(a): 20, str(tokenizer.special_token_id(END)): -100})
    plan = asyncio.run(plan_chat(state, engine, body))
    assert plan.params.structured.preamble is not None and not plan.params.structured.mostly_free
    (reply,) = engine.generate([plan.prompt.token_ids], plan.params)
    assert reply[0].finish_reason == "length" and tokenizer.special_token_id(END) not in reply[0].token_ids
    assert engine.stats.num_steps < 24 // 2
    assert engine.stats.kv_pages_used == 0


def test_a_vocabulary_whose_tags_are_text_binds_no_budget():
    tokenizer = think_tokenizer(special=False)
    assert not ReasoningFormat.binds_budget(tokenizer)
    assert ReasoningFormat.binds_budget(one_token_tags(special=False))
    with pytest.raises(ValueError, match="thinking budget"):
        DEEPSEEK.preamble(tokenizer, 8)


TEXT_TAGS = think_tokenizer(special=False)


class _Replay:
    """A generation that replays one choice's text in pieces (what a response builder reads), each piece as the
    tokens `TEXT_TAGS` encodes it to."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = [(piece, tuple(TEXT_TAGS.encode(piece, add_special_tokens=False))) for piece in pieces]
        self.usage = Usage(prompt_tokens=2, completion_tokens=sum(len(ids) for _, ids in self._pieces))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for i, (piece, ids) in enumerate(self._pieces):
            yield Increment(0, piece, ids, finish_reason="stop" if i == len(self._pieces) - 1 else None)


# A reply in pieces, with calls (True) or text (False) after its reasoning; what the reply is read for.
PIECES = {True: ["<th", "ink>Which", " tool?</th", "ink>\n\n", "<tool_call>", '{"name": "get_weather", "arguments": ',
                 '{"city": "Oslo"}}', "</tool_call>"],
          False: ["<th", "ink>Sum", " it.</think>", "\n", "Nine", "."]}
CALLING = {True: ToolCalling(frozenset({"get_weather"})), False: None}


def test_a_chat_reply_of_reasoning_alone_streamed_with_logprobs_has_no_content_as_the_whole_reply(smollm2):
    """An increment that shows nothing (a tag) still sends its logprobs, in a delta with no text: the stream
    adds up to content null, as the whole reply has it, not to ""."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                 "logprobs": True})
    builder = ChatBuilder("chatcmpl-1", "m", smollm2.tokenizer, body, [1], None, QWEN3)
    pieces = ["<think>", "hm", " hm"]
    replay = [Increment(0, piece, (5 + i,), (TokenLogprob(5 + i, -1.0),),
                        finish_reason="length" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]

    class Generation:
        usage = Usage(prompt_tokens=1, completion_tokens=3)

        async def increments(self):
            for increment in replay:
                yield increment

    async def deltas() -> list[dict]:
        events = [event async for event in builder.events(Generation())]
        return [json.loads(e.removeprefix(b"data: "))["choices"][0] for e in events[:-1]]

    choices = asyncio.run(deltas())
    assert not any("content" in c["delta"] for c in choices[1:])  # after the role's opening chunk
    assert "".join(c["delta"].get("reasoning", "") for c in choices) == "hm hm"
    assert sum(len(c["logprobs"]["content"]) for c in choices if c.get("logprobs")) == 3


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool calls"])
def test_a_chat_reply_streamed_and_whole_has_its_reasoning_apart_and_its_answer_read_for_calls(tools):
    pieces, calling = PIECES[tools], CALLING[tools]

    def builder(stream: bool) -> ChatBuilder:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": stream})
        return ChatBuilder("chatcmpl-1", "m", TEXT_TAGS, body, [1], calling, QWEN3)

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


def answering(events: list[bytes]) -> httpx2.Client:
    """An HTTP client that answers every request with `events` (a builder's stream), for an official client (whose
    HTTP is httpx2's)."""
    body = b"".join(events)
    return httpx2.Client(transport=httpx2.MockTransport(
        lambda request: httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})))


def _blocks(message: BaseModel) -> list[dict]:
    """A message's content blocks without their ids (a tool_use block's is new in each reply)."""
    return [{k: v for k, v in block.model_dump(exclude_none=True).items() if k != "id"} for block in message.content]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool calls"])
def test_an_anthropic_reply_thinks_in_a_first_block_that_the_clients_stream_assembles_as_the_whole_message(tools):
    def builder() -> MessageBuilder:
        return MessageBuilder("msg_1", MODEL, 2, CALLING[tools], QWEN3)

    async def stream() -> list[bytes]:
        return [event async for event in builder().events(_Replay(PIECES[tools]))]

    whole = asyncio.run(builder().collect(_Replay(PIECES[tools])))
    events = asyncio.run(stream())
    with anthropic.Anthropic(api_key=API_KEY, base_url="http://sluice", http_client=answering(events)) as client:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
            streamed = stream.get_final_message()
    thought = "Which tool?" if tools else "Sum it."
    assert _blocks(whole) == _blocks(streamed) == [
        {"type": "thinking", "thinking": thought, "signature": hashlib.sha256(thought.encode()).hexdigest()},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}} if tools else {"type": "text",
                                                                                             "text": "Nine."}]
    assert whole.stop_reason == streamed.stop_reason == ("tool_use" if tools else "end_turn")
    first = [json.loads(e.split(b"data: ")[1]) for e in events if b'"index":0' in e]
    assert [e.get("delta", e.get("content_block", {})).get("type") for e in first] == [
        "thinking", "thinking_delta", "thinking_delta", "signature_delta", None]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool calls"])
def test_a_responses_reply_has_a_reasoning_item_first_that_the_clients_stream_assembles_and_a_next_turn_reads(tools):
    done: list[ResponseObject] = []

    def builder() -> ResponsesBuilder:
        return ResponsesBuilder(blank_response(), CALLING[tools], done.append, reasoning=QWEN3, tokenizer=TEXT_TAGS)

    async def stream() -> list[bytes]:
        return [event async for event in builder().events(_Replay(PIECES[tools]))]

    whole = asyncio.run(builder().collect(_Replay(PIECES[tools])))
    events = asyncio.run(stream())
    with openai.OpenAI(api_key=API_KEY, base_url="http://sluice/v1", http_client=answering(events)) as client:
        with client.responses.stream(model=MODEL, input="x") as replay:
            streamed = replay.get_final_response()
    thought = "Which tool?" if tools else "Sum it."
    for response in (whole, streamed):
        reasoning, answer = response.output
        assert (reasoning.type, reasoning.summary, reasoning.status) == ("reasoning", [], "completed")
        assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", thought)]
        assert answer.type == ("function_call" if tools else "message")
    new_ids = {"id", "call_id"}  # each reply's own
    assert (streamed.output[1].model_dump(exclude_none=True, exclude=new_ids)
            == whole.output[1].model_dump(exclude_none=True, exclude=new_ids))
    types = [json.loads(e.split(b"data: ")[1])["type"] for e in events if b'"output_index":0' in e]
    assert types == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done"]
    [assistant] = chat_messages(stored_items(output_items(done[0].output), ""))
    assert assistant["reasoning_content"] == thought


TOKENS = {1: "<th", 2: "ink>", 3: "hm", 4: "</think>", 5: "\n\n", 6: "Nine", 7: ".", 8: "<|im_end|>"}


@pytest.mark.parametrize("increments", [
    [("<th", (1,), None), ("ink>", (2,), None), ("hm", (3,), None), ("</think>", (4,), None), ("\n\n", (5,), None),
     ("Nine", (6,), None), (".", (7,), None), ("", (8,), "stop")],
    [("<think>hm</think>\n\nNine", (1, 2, 3, 4, 5, 6), None), (".", (7, 8), "stop")],  # several tokens at once
    [("<think>hm</th", (1, 2, 3), None), ("ink>\n\nNine.", (4, 5, 6, 7, 8), "stop")],
], ids=["a-token-at-a-time", "thought-and-answer-together", "tag-across-increments"])
def test_a_responses_replys_output_text_logprobs_are_its_answers_tokens_alone(increments):
    """The reasoning's tokens, its tags' and the blank after them are no output text, and neither are their
    logprobs, whichever increments they share with the answer's."""
    def shown(entries):
        return [TokenLogprobInfo(token=TOKENS[e.token_id], logprob=e.logprob, bytes=list(TOKENS[e.token_id].encode()),
                                 top_logprobs=[]) for e in entries]

    def builder() -> ResponsesBuilder:  # (the ids are no vocabulary's: the usage's reasoning tokens go unread)
        return ResponsesBuilder(blank_response(), None, lambda _: None, shown, reasoning=QWEN3, tokenizer=TEXT_TAGS)

    async def run() -> tuple[ResponseObject, list[bytes]]:
        whole = await builder().collect(ScriptedGeneration(*increments))
        return whole, [e async for e in builder().events(ScriptedGeneration(*increments))]

    whole, frames = asyncio.run(run())
    reasoning, message = whole.output
    assert reasoning.content[0].text == "hm" and message.content[0].text == "Nine."
    assert [e.token for e in message.content[0].logprobs] == ["Nine", "."]
    deltas = [json.loads(f.decode().split("data: ", 1)[1])
              for f in frames if f.startswith(b"event: response.output_text.delta")]
    assert [e["token"] for d in deltas for e in d["logprobs"]] == ["Nine", "."]


# Token id -> its bytes, for replies that do not think: a held "<", leading blanks, a character split over two.
REPLY_BYTES = {11: b"<", 12: b"b", 13: b">", 14: b"hi", 15: b"  ", 16: b"x", 17: b" = 1", 18: b"\xc3", 19: b"\xa9",
               20: b"!", 8: b""}


@pytest.mark.parametrize(("increments", "text"), [
    ([("", (11,), None), ("<b>hi", (12, 13, 14), None), ("", (8,), "stop")], "<b>hi"),
    ([("", (15,), None), ("  x", (16,), None), (" = 1", (17, 8), "stop")], "  x = 1"),
    ([("", (18,), None), ("é!", (19, 20), None), ("", (8,), "stop")], "é!"),
], ids=["held-start-of-a-tag", "leading-blanks", "split-character"])
def test_a_responses_reply_that_does_not_think_keeps_every_tokens_logprob(increments, text):
    """Text the reader holds (it may start <think>) is the answer's once it is not: its tokens' logprobs too."""
    def shown(entries):
        return [TokenLogprobInfo(token=REPLY_BYTES[e.token_id].decode(errors="replace"), logprob=e.logprob,
                                 bytes=list(REPLY_BYTES[e.token_id]), top_logprobs=[]) for e in entries]

    whole = asyncio.run(ResponsesBuilder(blank_response(), None, lambda _: None, shown, reasoning=QWEN3,
                                         tokenizer=TEXT_TAGS).collect(ScriptedGeneration(*increments)))
    [message] = whole.output
    ids = [t for _, tokens, _ in increments for t in tokens if t != 8]
    assert message.content[0].text == text
    assert [e.logprob for e in message.content[0].logprobs] == [-float(t) for t in ids]


# --- served -----------------------------------------------------------------------------------------------------

MODEL = "tiny-thinking"
FLAGS = ["--skip-server-warmup", "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--kv-cache-memory",
         "8MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui"]
VOCABULARY = think_tokenizer(special=True)  # the served model's: its tags are special tokens
OPEN, CLOSE = (VOCABULARY.special_token_id(tag) for tag in (START, END))
[A] = VOCABULARY.encode("a", add_special_tokens=False)
ANSWER = {"structured_outputs": {"regex": "[a-z]{2,8}"}, "temperature": 0}
# The tiny random model writes a tag only where a bias makes it: it opens with <think>, writes "a" until the
# frequency penalty takes it below </think> (a few times), then answers by the grammar.
THINKING = {**ANSWER, "logit_bias": {OPEN: 100, A: 20, CLOSE: 10}, "frequency_penalty": 2}
PLAIN = {**ANSWER, "logit_bias": {OPEN: -100}}


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
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=1024), seed=7,
                    chat_template=TEMPLATE)
    tag_vocabulary(special=True).save(str(folder / "tokenizer.json"))  # VOCABULARY's
    return folder


def serve(folder, tmp_path_factory, parser: str, *flags: str):
    return start_server("--model", str(folder), *FLAGS, "--reasoning-parser", parser, *flags,
                        env={"SLUICE_HOME": str(tmp_path_factory.mktemp("home"))})


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    proc = serve(folder, tmp_path_factory, "qwen3")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def r1_server(folder, tmp_path_factory):
    """A server whose replies all start inside their reasoning (deepseek_r1): the tiny model's, cut short by
    max_tokens, are all reasoning."""
    proc = serve(folder, tmp_path_factory, "deepseek_r1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def r1_client(r1_server):
    with openai.OpenAI(base_url=f"{r1_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("served", ["client", "r1_client"], ids=["qwen3", "deepseek_r1"])
def test_a_served_reply_under_a_grammar_thinks_then_answers_by_the_grammar_whole_and_streamed(request, served):
    client = request.getfixturevalue(served)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40,
                                           extra_body={**THINKING, "return_token_ids": True})
    message = reply.choices[0].message
    thought, answer = message.model_extra["reasoning"], message.content
    assert message.model_extra["reasoning_content"] == thought and set(thought) == {"a"}
    assert re.fullmatch("[a-z]{2,8}", answer) and reply.choices[0].finish_reason == "stop"
    ids = reply.choices[0].token_ids
    counted = ids.index(CLOSE) - ids.index(OPEN) - 1  # the tokens between the tags
    assert reply.usage.completion_tokens_details.reasoning_tokens == counted
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=THINKING))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == counted


def test_a_served_qwen3_reply_under_a_grammar_that_does_not_think_is_all_answer(client):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, extra_body=PLAIN)
    assert re.fullmatch("[a-z]{2,8}", plain.choices[0].message.content)
    assert "reasoning" not in plain.choices[0].message.model_extra
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0  # with a parser, counted even when none


def test_a_served_reply_under_a_grammar_cut_by_max_tokens_while_thinking_freely_is_all_reasoning(r1_client):
    reply = r1_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                              extra_body={**ANSWER, "logit_bias": {CLOSE: -100}})
    message = reply.choices[0].message
    assert not re.fullmatch("[a-z]*", message.model_extra["reasoning"])  # the grammar holds only the answer
    assert message.content is None and reply.choices[0].finish_reason == "length"


def test_a_served_deepseek_r1_prefill_is_continued_as_answer_not_reasoning(r1_server, r1_client):
    """A reply continuing a final assistant message (Anthropic's prefill, chat's continue_final_message) starts in
    that message's answer, not in a <think> the template opened."""
    prefill = [*HELLO, {"role": "assistant", "content": "the"}]
    reply = r1_client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6,
                                              extra_body={"continue_final_message": True,
                                                          "add_generation_prompt": False, **PLAIN})
    assert re.fullmatch("[a-z]{2,8}", reply.choices[0].message.content)
    assert "reasoning" not in reply.choices[0].message.model_extra
    with anthropic.Anthropic(base_url=r1_server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        message = client.messages.create(model=MODEL, messages=prefill, max_tokens=6, extra_body={"temperature": 0})
    assert [block.type for block in message.content] == ["text"]


@pytest.mark.parametrize("budget", [0, 5])
def test_a_served_thinking_budget_closes_the_thought_after_that_many_tokens(r1_client, budget):
    """vLLM's `thinking_token_budget`: the tiny model, kept from </think> by a bias, thinks until max_tokens unless
    the budget forces the tag; then it answers."""
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16)
    fields = {"temperature": 0, "logit_bias": {CLOSE: -100}, "return_token_ids": True}
    free = r1_client.chat.completions.create(**kwargs, extra_body=fields).choices[0]
    assert CLOSE not in free.token_ids and free.finish_reason == "length"
    reply = r1_client.chat.completions.create(**kwargs, extra_body={**fields, "thinking_token_budget": budget})
    ids = reply.choices[0].token_ids
    thought = ids[:ids.index(CLOSE)]
    assert len(thought[1:] if thought[:1] == [OPEN] else thought) == budget  # a <think> of its own is no thought
    message = reply.choices[0].message
    assert message.content and bool(message.model_extra.get("reasoning")) == (budget > 0)


def test_a_served_thinking_budget_past_max_tokens_thinks_as_without_one(r1_client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16)
    fields = {"temperature": 0, "logit_bias": {CLOSE: -100}, "return_token_ids": True}
    free = r1_client.chat.completions.create(**kwargs, extra_body=fields).choices[0]
    bound = r1_client.chat.completions.create(**kwargs, extra_body={**fields, "thinking_token_budget": 2 ** 40})
    assert bound.choices[0].token_ids == free.token_ids


def test_a_served_thinking_budget_with_ignore_eos_answers_until_max_tokens(r1_client):
    """The tiny model, biased to EOS, writes one as soon as its thought of two tokens is over."""
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=12)
    fields = {"temperature": 0, "logit_bias": {2: 100}, "thinking_token_budget": 2}
    ended = r1_client.chat.completions.create(**kwargs, extra_body=fields)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 12
    going = r1_client.chat.completions.create(**kwargs, extra_body={**fields, "ignore_eos": True})
    assert going.choices[0].finish_reason == "length" and going.usage.completion_tokens == 12


@pytest.fixture(scope="module")
def speculating_client(folder, tmp_path_factory):
    """A deepseek_r1 server that checks n-gram drafts (`--speculative ngram`)."""
    proc = serve(folder, tmp_path_factory, "deepseek_r1", "--speculative", "ngram")
    with openai.OpenAI(base_url=f"{proc.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client
    proc.stop()


def test_a_served_thinking_budget_holds_while_the_engine_checks_drafts(speculating_client):
    """The tiny model's thought repeats its prompt's spaces, which n-grams draft past the budget."""
    messages = [{"role": "user", "content": " ".join("a" * 24)}]
    reply = speculating_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30,
        extra_body={"temperature": 0, "logit_bias": {CLOSE: -100}, "return_token_ids": True,
                    "thinking_token_budget": 6})
    ids = reply.choices[0].token_ids
    assert ids.index(CLOSE) == 6 and reply.choices[0].finish_reason == "length"


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
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
     "effort: low\nthinking: True\n"),
    ({}, "fox\nassistant\n"),  # special tokens (<s>, </s>) have no text
], ids=["high", "none", "thinking set", "kwargs effort replaced", "not set"])
def test_chats_reasoning_effort_reaches_the_template_with_enable_thinking_as_vllm_passes_them(server, client, fields,
                                                                                              shown):
    text, length = rendered(server, HELLO, **fields)
    assert shown in text and ("effort" in text) == bool(fields)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, extra_body=fields)
    assert reply.usage.prompt_tokens == length


@pytest.mark.parametrize(("thinking", "enabled"), [({"type": "enabled", "budget_tokens": 1024}, True),
                                                   ({"type": "adaptive"}, True), ({"type": "disabled"}, False)])
def test_anthropics_thinking_reaches_the_template_as_enable_thinking(server, thinking, enabled):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        counted = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking=thinking,
                                               output_config={"effort": "high"}).input_tokens
    text, length = rendered(server, HELLO, chat_template_kwargs={"enable_thinking": enabled},
                            reasoning_effort="high")
    assert counted == length and f"effort: high\nthinking: {enabled}" in text


def test_a_served_anthropic_message_thinks_in_a_signed_block_that_its_stream_assembles_alike(r1_server):
    kwargs = dict(model=MODEL, max_tokens=12, messages=HELLO, thinking={"type": "adaptive"},
                  extra_body={"temperature": 0})
    with anthropic.Anthropic(base_url=r1_server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
    [block] = whole.content
    assert block.type == "thinking" and block.thinking and block.signature
    assert _blocks(streamed) == _blocks(whole) and streamed.stop_reason == whole.stop_reason == "max_tokens"


def test_the_responses_apis_reasoning_effort_reaches_the_template(server, client):
    reply = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=1,
                                    reasoning={"effort": "low", "summary": "auto"})
    text, length = rendered(server, HELLO, reasoning_effort="low")
    assert reply.usage.input_tokens == length and "effort: low\nthinking: True" in text
    assert (reply.reasoning.effort, reply.reasoning.summary) == ("low", "auto")


def test_a_served_response_reasons_in_an_item_streamed_alike_and_stored(r1_server):
    with openai.OpenAI(base_url=f"{r1_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        whole = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=12, temperature=0)
        events = list(client.responses.create(model=MODEL, input=HELLO, max_output_tokens=12, temperature=0,
                                              stream=True))
        streamed = events[-1].response  # response.incomplete's (the client's stream helper waits for completed)
        stored = client.responses.retrieve(whole.id)
        ids = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0].token_ids
    [reasoning] = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text and whole.status == "incomplete"
    assert [item.content for item in streamed.output] == [reasoning.content] == [item.content for item in stored.output]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    thought = len(ids) - (ids[0] == OPEN)  # cut short while thinking: all its tokens but a <think> of its own
    assert whole.usage.output_tokens_details.reasoning_tokens == streamed.usage.output_tokens_details.reasoning_tokens
    assert whole.usage.output_tokens_details.reasoning_tokens == thought
