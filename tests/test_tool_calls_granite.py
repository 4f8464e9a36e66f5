"""Granite 3.x's tool calls (`--tool-call-parser granite`, vLLM's): `<|tool_call|>` (or Granite 3.1's `<tool_call>`)
then a JSON list of `{"name", "arguments"}` objects. The reader on its own, the grammar that forces calls, the
vocabulary whose `<|tool_call|>` is a special token, then the official `openai` client against a real
`sluice serve` with a tiny random model whose template is shaped as Granite's."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from tokenizers import AddedToken

from sluice.app.prompts import tool_call_format
from sluice.app.tool_call_streams import ArgumentsDelta, CallStart, ToolCall
from sluice.app.tool_calls import ToolCalling, call_grammar, parse_calls, reads_special_tokens, special_marker
from sluice.batching.structured import GrammarCompiler
from sluice.model.config import ModelConfig
from sluice.model.tokenizer import SpecialTokens, Tokenizer

from hf_folder import train_tokenizer, write_hf_folder
from test_api_e2e import API_KEY, start_server
from test_tool_calls_mistral import ASK, CART, SCHEMA, WEATHER
from test_tool_calls import (  # noqa: F401 (compiler: a fixture)
    ADD,
    NAMES,
    PARIS,
    assert_any_pieces_read_as_the_whole,
    compiler,
    follows,
    keeping_special_tokens,
    read,
    reassemble,
    stream_in_pieces,
    with_template,
)

MARKER = "<|tool_call|>"


def granite(*calls: tuple[str, str], marker: str = MARKER) -> str:
    return marker + "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


# --- the reader ------------------------------------------------------------------------------------------------


def test_a_granite_list_after_the_marker_is_calls_and_the_text_before_it_content():
    text = "Let me check. " + granite(("get_weather", PARIS), ("add", '{"a": [1, {"b": "]"}]}'))
    assert parse_calls(text, NAMES, "granite") == (
        "Let me check.", [ToolCall("get_weather", PARIS), ToolCall("add", '{"a": [1, {"b": "]"}]}')])


def test_granite_3_1s_tool_call_string_is_a_marker_too():
    text = granite(("add", '{"a": 1}'), marker="<tool_call>\n")
    assert parse_calls(text, NAMES, "granite") == (None, [ToolCall("add", '{"a": 1}')])


@pytest.mark.parametrize("text", [
    granite(("get_weather", PARIS), ("launch", "{}")),  # one element names no tool: the whole list is text
    '<|tool_call|>[{"name": "add", "arguments": {"a": 1}}; {"name": "add", "arguments": {}}]',
    '<|tool_call|>{"name": "add", "arguments": {"a": 1}}',  # no list
    '<|tool_call|>[{"name": "add", "arguments": {"a": 1}}',  # the list never closes
    '<|tool_call|>[{"name": "add", "arguments": {"a": 1}]',  # malformed JSON
    '<|tool_call|>[{"name": "add", "arguments": "a=1"}]',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {}}</tool_call>',  # Hermes's call is no Granite call
])
def test_a_granite_marker_followed_by_anything_but_a_list_of_calls_stays_in_the_text(text):
    assert parse_calls(text, NAMES, "granite") == (text, [])


@pytest.mark.parametrize("text", [
    " Sure. " + granite(("get_weather", PARIS)) + " and <|tool_call|>[{broken}] <|tool_ca",
    granite(("add", '{"a": {"b": {}}}'), ("add", '{"x": "]}"}')) + "\n\n"
    + granite(("get_weather", "{}"), marker="<tool_call>"),
    "no calls here, but a [ and a <|tool and a <tool",
    'an unfinished <|tool_call|>[{"name": "add", "arguments": {"a": 1}}, {"na',
    '<tool_call> <|tool_call|> [{"name": "add", "arguments": {"s": "<|tool_call|>["}}] <tool_ca',
])
def test_a_granite_stream_in_any_pieces_reassembles_to_the_parse_of_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "granite")


def test_forced_granite_calls_stream_each_ones_arguments_as_they_arrive():
    text = granite(("add", '{"a": {"b": [1, 2]}, "c": "}"}'), ("get_weather", '{"city": "Oslo"}'))
    content, calls, events = stream_in_pieces(text, progressive=True, rng=random.Random(4), parser="granite")
    assert (content, calls) == parse_calls(text, NAMES, "granite")
    assert isinstance(events[0], CallStart) and [e.index for e in events if isinstance(e, CallStart)] == [0, 1]
    assert sum(isinstance(e, ArgumentsDelta) for e in events) > 4


def test_without_parallel_calls_a_granite_reply_keeps_its_first_call_alone():
    text = granite(("add", "{}"), ("get_weather", PARIS))
    assert ToolCalling(NAMES, "granite", parallel=False).parse(text) == (None, [ToolCall("add", "{}")])


# --- the marker as a special token -----------------------------------------------------------------------------


def granite_tokenizer() -> Tokenizer:
    """A byte-level vocabulary of 288 tokens whose last is `<|tool_call|>`, a special token (as in Granite's)."""
    backend = train_tokenizer(287)
    backend.add_special_tokens([AddedToken(MARKER, special=True, normalized=False)])
    return Tokenizer(backend, SpecialTokens(1, (2,), False, None))


def test_a_granite_vocabulary_whose_marker_is_a_special_token_reads_special_tokens_text():
    tokenizer, plain = granite_tokenizer(), Tokenizer(train_tokenizer(300), SpecialTokens(1, (2,), False, None))
    assert special_marker(tokenizer, "granite") == 287 and reads_special_tokens(tokenizer, "granite")
    assert special_marker(plain, "granite") is None and not reads_special_tokens(plain, "granite")
    assert not reads_special_tokens(tokenizer, "mistral")


def test_a_granite_call_after_its_special_marker_is_read_from_the_kept_text():
    tokenizer = granite_tokenizer()
    reply = "the fox" + granite(("add", '{"a": 1}'), ("get_weather", "{}"))
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit(token, None).text for token in tokenizer.encode(reply, add_special_tokens=False)]
    stream = ToolCalling(NAMES, "granite").stream()
    events = [event for text in texts for event in stream.push(text)] + stream.finish()
    assert read(events) == ("the fox", [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")])


# --- the grammar that forces calls -------------------------------------------------------------------------------


def granite_follows(compiler: GrammarCompiler, parallel: bool, text: str) -> bool:
    """Whether `text` is a complete output of the Granite grammar of `add` and `get_weather`."""
    return follows(compiler, call_grammar([ADD, ("get_weather", None)], parallel=parallel, parser="granite"), text)


def test_the_granite_grammar_takes_a_list_of_calls_with_arguments_that_follow_the_schema(compiler):
    one, two = granite(("add", '{"a": 1}')), granite(("add", '{"a": 1}'), ("get_weather", "{}"))
    assert granite_follows(compiler, False, one) and not granite_follows(compiler, False, two)
    assert granite_follows(compiler, True, two)
    assert not granite_follows(compiler, True, one.replace("1", '"1"'))
    assert not granite_follows(compiler, True, one.replace("{", "{ ", 1))
    assert not granite_follows(compiler, True, one.replace(MARKER, ""))


def test_the_granite_grammar_writes_a_special_marker_as_its_token():
    tokenizer = granite_tokenizer()
    compiler = GrammarCompiler(tokenizer, 288, (2,))
    grammar = call_grammar([ADD], parallel=False, parser="granite", marker_id=special_marker(tokenizer, "granite"))
    reply = tokenizer.encode(granite(("add", '{"a": 1}')), add_special_tokens=False)
    matcher = compiler.compile(grammar).matcher
    assert reply[0] == 287 and all(matcher.consume_token(t) for t in reply) and matcher.is_accepting()
    spelled = compiler.compile(grammar).matcher
    assert not spelled.consume_token(tokenizer.encode("<", add_special_tokens=False)[0])


# --- the template ------------------------------------------------------------------------------------------------

# Shaped as Granite 3.x's: the tools as a JSON list of their own role, a system prompt that asks for `<|tool_call|>`
# then a JSON list, every message as its role and content.
GRANITE = (
    "{% if tools %}<|start_of_role|>system<|end_of_role|>When a tool is required to answer the user's query, respond "
    "only with <|tool_call|> followed by a JSON list of tools used.<|end_of_text|>\n"
    "<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>\n{% endif %}"
    "{% for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}<|end_of_text|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)


def test_auto_reads_the_granite_format_from_a_template_that_writes_its_marker():
    assert tool_call_format("auto", with_template(GRANITE)) == "granite"


# --- the openai client against a real server ---------------------------------------------------------------------

MODEL = "tiny-granite"
FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--kv-cache-memory", "16MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui",
         "--tool-call-parser", "auto"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("granite") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288, max_position_embeddings=2048), seed=7)
    tokenizer = train_tokenizer(287)
    tokenizer.add_special_tokens([AddedToken(MARKER, special=True, normalized=False)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GRANITE}))
    server = start_server("--model", str(folder), *FLAGS, env={"SLUICE_HOME": str(tmp_path_factory.mktemp("home"))})
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
            yield c
    finally:
        server.stop()


def test_required_calls_in_the_granite_format_come_back_valid(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.8, seed=1, n=4, max_tokens=200)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add_to_cart"}},
                                         "auto"])
def test_streamed_granite_deltas_reassemble_to_the_unstreamed_reply_at_temperature_0(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice=tool_choice,
                  parallel_tool_calls=False, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish, ids = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason and len(ids) == len(calls)
    if tool_choice != "auto":
        assert calls and finish == "tool_calls"
