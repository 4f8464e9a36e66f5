"""Tool calling on /v1/chat/completions: the Hermes parser on its own, then the official `openai` client against a
real `sluice serve` with SmolLM2 (whose template has no tools: the default format, forced by a grammar where
tool_choice asks)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest

from test_api_e2e import API_KEY
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from sluice.app.prompts import chat_prompt, renders_tools, tool_call_format
from sluice.app.routes import calls_grammar
from sluice.app.schemas import ChatCompletionRequest, FunctionCall
from sluice.app.tool_call_streams import ArgumentsDelta, CallStart, TextDelta, ToolCall
from sluice.app.tool_calls import (
    ToolCalling,
    args_token,
    call_grammar,
    hermes_tags,
    mistral_call_id,
    parse_calls,
    special_marker,
    tag_token_ids,
)
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.batching.stop_checker import StopChecker
from sluice.batching.structured import GrammarCompiler
from hf_folder import train_tokenizer, train_tokenizer_with_special_tokens
from tool_call_servers import TOOL_CHOICES, assert_streamed_deltas_reassemble_to_the_unstreamed_reply, openai_client
from sluice.model.tokenizer import SpecialTokens, Tokenizer

NAMES = frozenset({"get_weather", "add"})
PARIS = '{"city": "Paris"}'


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# --- the Hermes parser ---------------------------------------------------------------------------------------


def test_text_before_and_after_a_call_is_kept_as_content():
    text = f"Let me look.\n{call('get_weather', PARIS)}\nDone."
    assert parse_calls(text, NAMES) == ("Let me look.\n\nDone.", [ToolCall("get_weather", PARIS)])


def test_several_calls_come_back_in_order_with_their_own_arguments_text():
    text = call("add", '{"a": 1, "b": {"c": [2, 3]}}') + "\n" + call("get_weather", "{}")
    assert parse_calls(text, NAMES) == (None, [ToolCall("add", '{"a": 1, "b": {"c": [2, 3]}}'),
                                               ToolCall("get_weather", "{}")])


@pytest.mark.parametrize("body", [
    '{"name": "add", "arguments": {"a": 1}',  # malformed JSON
    '{"name": "delete_everything", "arguments": {}}',  # not one of the request's tools
    '{"name": "add", "arguments": "a=1"}',  # arguments not an object
    '{"name": ["add"], "arguments": {}}',  # a name that is no string
])
def test_what_is_not_a_call_stays_in_the_text(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    assert parse_calls(text, NAMES) == (text, [])


def test_a_closing_tag_inside_a_string_does_not_end_the_call():
    text = call("add", '{"note": "</tool_call> is a tag"}')
    assert parse_calls(text, NAMES) == (None, [ToolCall("add", '{"note": "</tool_call> is a tag"}')])


def test_a_tag_followed_by_no_call_is_text_and_a_call_after_it_still_counts():
    text = f"<tool_call> I will call: {call('get_weather', PARIS)}"
    assert parse_calls(text, NAMES) == ("<tool_call> I will call:", [ToolCall("get_weather", PARIS)])


def test_arguments_written_in_another_order_or_layout_are_reserialized():
    text = '<tool_call>{"arguments":{"a":1},"name":"add"}</tool_call>'
    assert parse_calls(text, NAMES) == (None, [ToolCall("add", '{"a": 1}')])


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>{"arguments": {"s": "\\ud83d é", "\\udc00": 1}, "name": "add"}</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"s": "\\ud83d é", "\\udc00": 1}}'),
])
def test_reserialized_arguments_keep_a_lone_surrogate_escaped_and_other_characters_as_they_are(parser, text):
    # A `\ud83d` with no pair is a character no UTF-8 response can carry: the reply's JSON would not serialize.
    (call,) = parse_calls(text, NAMES, parser)[1]
    assert json.loads(call.arguments) == {"s": "\ud83d é", "\udc00": 1} and "é" in call.arguments
    FunctionCall(name=call.name, arguments=call.arguments).model_dump_json()


def stream_in_pieces(text: str, progressive: bool, rng: random.Random, parser: str = "hermes", parallel: bool = True
                     ) -> tuple[str | None, list[ToolCall], list]:
    stream = ToolCalling(NAMES, parser, forced=progressive, parallel=parallel).stream()
    events, start = [], 0
    while start < len(text):
        size = rng.randint(1, 6)
        events += stream.push(text[start:start + size])
        start += size
    events += stream.finish()
    return (*read(events), events)


def read(events: list) -> tuple[str | None, list[ToolCall]]:
    """The content and calls a reader's events make up."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta)) or None
    calls = [ToolCall(e.name, "".join(a.text for a in events if isinstance(a, ArgumentsDelta) and a.index == e.index))
             for e in events if isinstance(e, CallStart)]
    return content, calls


def assert_any_pieces_read_as_the_whole(text: str, parser: str) -> None:
    rng = random.Random(0)
    for _ in range(50):
        content, calls, _ = stream_in_pieces(text, progressive=False, rng=rng, parser=parser)
        assert (content, calls) == parse_calls(text, NAMES, parser)


@pytest.mark.parametrize("text", [
    f" Sure. {call('get_weather', PARIS)} and <tool_call>{{broken</tool_call> <tool_ca",
    call("add", '{"a": {"b": {}}}') + "\n" + call("add", '{"x": "}}"}') + "\n\n",
    "no calls here, but a < and a <tool",
    "text then an unfinished <tool_call>\n{\"name\": \"add\", \"arg",
    call("add", '{"s": "</tool_call>{\\"}"}') + " <tool_call> <tool_call>" + call("add", "{}"),
])
def test_a_stream_in_any_pieces_reassembles_to_the_parse_of_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "hermes")


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n', "Sure.", [ToolCall("add", '{"a": 1}')]),
    (call("add", "{}") + '\n<tool_call>{"name": "get_weather", "arguments": ' + PARIS + "}", None,
     [ToolCall("add", "{}"), ToolCall("get_weather", PARIS)]),
])
def test_a_call_whose_closing_tag_the_reply_ends_without_is_still_a_call(text, content, calls):
    # A model that stops (EOS or a stop string) right after its JSON; vLLM's Hermes parser reads it as a call too.
    assert parse_calls(text, NAMES) == (content, calls)
    assert_any_pieces_read_as_the_whole(text, "hermes")


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}',  # cut inside the JSON
    '<tool_call>{"name": "launch", "arguments": {}}',  # not one of the request's tools
    '<tool_call>{"name": "add", "arguments": {}} and some prose',
])
def test_an_unclosed_call_that_is_not_whole_json_naming_a_tool_stays_text(text):
    assert parse_calls(text, NAMES) == (text, [])
    assert_any_pieces_read_as_the_whole(text, "hermes")


def test_forced_calls_stream_their_arguments_as_they_arrive():
    text = call("add", '{"a": {"b": [1, 2]}, "c": "}"}') + "\n" + call("get_weather", '{"city": "Oslo"}')
    content, calls, events = stream_in_pieces(text, progressive=True, rng=random.Random(1))
    assert (content, calls) == parse_calls(text, NAMES)
    assert isinstance(events[0], CallStart) and sum(isinstance(e, ArgumentsDelta) for e in events) > 4


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", call("add", '{"a": 1} x')),  # a character no JSON has outside strings
    ("hermes", call("add", '{"a": tru}')),  # the object closes, but it is no JSON
    ("hermes", call("add", '[1, 2]') + " Bye."),  # the arguments are no object
    ("hermes", "Sure. " + call("add", '{"a": 1} x')),  # its text, from the object on, after other text
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": "b"}}, {"name": "add", "arguments": {"a": Oslo}}]'),
])
def test_a_forced_call_that_turns_out_no_call_reads_the_same_whole_and_in_any_pieces(parser, text):
    # Off the grammar (a thought under a thinking budget may spell </think> and go on as the answer): the arguments
    # that went out stay out, so the whole text reads as its stream does, whatever the pieces.
    calling = ToolCalling(NAMES, parser, forced=True)
    whole = calling.parse(text)
    assert len(whole[1]) == (2 if parser == "mistral" else 1)
    assert all(read_pieces(calling, texts) == whole for texts in split_anywhere(text))


@pytest.mark.parametrize(("parser", "text", "read_as"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments', (None, [])),
    ("hermes", 'Sure. <tool_', ("Sure.", [])),
    ("hermes", 'Sure. <tool_call>\n{"na', ("Sure.", [])),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"ci', (None, [ToolCall("get_weather", '{"ci')])),
    # Cut after the arguments closed, before the call's object did: the braces held back were the arguments'.
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "c": {"d": 12}}',
     (None, [ToolCall("add", '{"a": 1, "c": {"d": 12}}')])),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": {"b": 1} ', (None, [ToolCall("add", '{"a": {"b": 1}')])),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "argu', (None, [])),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "param',
     (None, [ToolCall("add", '{"a": 1}')])),
    ("mistral", '[TOOL_CALLS]get_wea', (None, [])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', (None, [ToolCall("get_weather", '{"city": "Pa')])),
    # Off the grammar: not the head it writes, so text as ever.
    ("hermes", '<tool_call>{"arguments": {}, "name": "add"', ('<tool_call>{"arguments": {}, "name": "add"', [])),
])
def test_a_forced_reply_cut_inside_its_markup_is_no_text_and_a_call_only_once_its_arguments_began(parser, text,
                                                                                                  read_as):
    # max_tokens or a stop ended the reply the grammar was writing: its markup never was the model's text.
    calling = ToolCalling(NAMES, parser, forced=True)
    assert calling.parse(text) == read_as
    assert all(read_pieces(calling, texts) == read_as for texts in split_anywhere(text))


def split_anywhere(text: str) -> list[list[str]]:
    """`text` in two pieces at each position, and a character a piece."""
    return [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]


def read_pieces(calling: ToolCalling, texts: list[str]) -> tuple[str | None, list[ToolCall]]:
    stream = calling.stream()
    return read([event for text in texts for event in stream.push(text)] + stream.finish())


@pytest.mark.parametrize(("body", "name", "arguments"), [
    ('{"name": "add", "arguments": {"a": 1}, "arguments": {"b": 2}}', "add", '{"a": 1}'),
    ('{"name": "add", "arguments": {"a": 1} , "id": 7}', "add", '{"a": 1}'),
    ('{"name": "add", "arguments": {"a": 1}, "name": "get_weather"}', "add", '{"a": 1}'),
    ('{"name": "add", "arguments": {"a": {"b": "}"}}\n, "id": "x"}', "add", '{"a": {"b": "}"}}'),
])
def test_a_forced_call_is_the_arguments_and_name_its_head_wrote_whole_and_in_any_pieces(body, name, arguments):
    # Off the grammar, the rest of the object would read otherwise (a key after the arguments, or one written
    # twice), but what went out of the arguments as they arrived stays out; and only the arguments' own text goes
    # out, never a key after them.
    text = f"<tool_call>{body}</tool_call>"
    calling = ToolCalling(NAMES, "hermes", forced=True)
    assert calling.parse(text) == (None, [ToolCall(name, arguments)])
    assert all(read_pieces(calling, texts) == (None, [ToolCall(name, arguments)]) for texts in split_anywhere(text))


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}, '
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "bcdefghij"}]',
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}, '
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "bcdef',  # cut after the arguments
])
def test_a_mistral_call_id_after_the_arguments_is_no_part_of_them_forced_or_not(text):
    # Some versions of Mistral's template write each call's id after its arguments; vLLM's parser reads the
    # `arguments` key alone, whole and streamed.
    calls = [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", PARIS)]
    if text.endswith("]"):
        assert parse_calls(text, NAMES, "mistral") == (None, calls)
    calling = ToolCalling(NAMES, "mistral", forced=True)
    assert calling.parse(text) == (None, calls)
    assert all(read_pieces(calling, texts) == (None, calls) for texts in split_anywhere(text))


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "Sure. " + call("add", '{"a": 1}') + "\n" + call("get_weather", PARIS) + " Bye."),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "P"}}'),
])
def test_without_parallel_calls_a_reply_keeps_its_first_call_alone(parser, text):
    whole = ToolCalling(NAMES, parser, parallel=False).parse(text)
    assert whole[1] == [ToolCall("add", '{"a": 1}')] and whole[0] == parse_calls(text, NAMES, parser)[0]
    rng = random.Random(6)
    for progressive in (False, True):
        content, calls, _ = stream_in_pieces(text, progressive, rng, parser, parallel=False)
        assert (content, calls) == whole


# --- Llama 3's JSON calls ----------------------------------------------------------------------------------


def test_a_llama3_reply_of_calls_separated_by_semicolons_is_calls():
    text = ' {"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}\n'
    assert parse_calls(text, NAMES, "llama3_json") == (
        None, [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "add", "parameters": {"a": 1}} and then some prose',
    '{"name": "launch", "parameters": {}}',
    '{"name": "add", "parameters": {"a": 1}',
    '{"name": {"add": 1}, "parameters": {}}',
    '{"name": "add", "parameters": {"a": NaN}}',  # Python's decoder takes NaN and Infinity; JSON has neither
    '{"name": "add", "parameters": {"a": -Infinity}}',
    '{"name": "add", "parameters": {"a": 1}}; 5',  # JSON after the separator, but no object
])
def test_any_other_llama3_reply_is_text_whole(text):
    assert parse_calls(text, NAMES, "llama3_json") == (text.strip(), [])


@pytest.mark.parametrize("text", [
    '\n {"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {}}',
    "  Plain text,\n in lines.  ",
    '{"name": "add", "parameters": {"a": 1}} trailing',
])
def test_a_llama3_stream_in_any_pieces_reads_as_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "llama3_json")


@pytest.mark.parametrize("end", [";", "; ", ";\n", " ;"])
def test_a_llama3_separator_after_the_last_call_leaves_the_reply_calls(end):
    # Llama 3 separates its calls by "; " and may end the last one with it too; vLLM's llama3_json parser reads
    # the calls.
    for text in ('{"name": "add", "parameters": {"a": 1}}' + end,
                 '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}' + end):
        assert parse_calls(text, NAMES, "llama3_json")[0] is None
        assert parse_calls(text, NAMES, "llama3_json")[1][0] == ToolCall("add", '{"a": 1}')
        assert_any_pieces_read_as_the_whole(text, "llama3_json")
    for text in ('{"name": "add", "parameters": {"a": 1}};;', '{"name": "add", "parameters": {"a": 1}}; and more'):
        assert parse_calls(text, NAMES, "llama3_json") == (text, [])


@pytest.mark.parametrize(("text", "arguments"), [
    ('{"name": "add", "arguments": {"a": 1}}', '{"a": 1}'),
    ('{"name": "add", "arguments": {"a": 1}, "parameters": {"b": 2}}', '{"a": 1}'),
    ('{"name": "add", "parameters": {"b": 2}, "arguments": {"a": 1}}', '{"a": 1}'),
    ('{"name": "add", "arguments": {"a": 1}, "parameters": "b=2"}', '{"a": 1}'),
    ('{"name": "add", "arguments": "a=1", "parameters": {"b": 2}}', None),  # the arguments are no object
])
def test_a_llama3_call_may_write_arguments_for_parameters_and_where_it_writes_both_the_arguments_count(text,
                                                                                                      arguments):
    # As vLLM's llama3_json parser reads them ("arguments" if the object has that key, else "parameters").
    expected = (None, [ToolCall("add", arguments)]) if arguments is not None else (text, [])
    assert parse_calls(text, NAMES, "llama3_json") == expected
    assert_any_pieces_read_as_the_whole(text, "llama3_json")


def test_llama3_calls_after_a_kept_python_tag_are_calls_and_the_tag_no_content():
    # `skip_special_tokens: false` keeps the `<|python_tag|>` token Llama 3 may open its calls with; vLLM's
    # llama3_json parser reads the calls after it.
    tokenizer = Tokenizer(train_tokenizer_with_special_tokens("<|python_tag|>"), SpecialTokens(1, (2,), False, None))
    reply = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit(token, None).text for token in tokenizer.encode(reply, add_special_tokens=False)]
    assert "".join(texts) == reply
    assert read_pieces(ToolCalling(NAMES, "llama3_json"), texts) == (None, [ToolCall("add", '{"a": 1}')])
    assert_any_pieces_read_as_the_whole(reply, "llama3_json")
    assert parse_calls("<|python_tag|>The weather is fine.", NAMES, "llama3_json") == (
        "<|python_tag|>The weather is fine.", [])


# --- Mistral's calls ----------------------------------------------------------------------------------------


def listed_after(marker: str, *calls: tuple[str, str]) -> str:
    """`calls` as a JSON list of `{"name", "arguments"}` objects after `marker`: Mistral's format, and Granite's."""
    return marker + "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def mistral(*calls: tuple[str, str]) -> str:
    return listed_after("[TOOL_CALLS] ", *calls)


def test_a_mistral_list_after_the_marker_is_calls_and_the_text_before_it_content():
    text = "Let me check. " + mistral(("get_weather", PARIS), ("add", '{"a": [1, {"b": "]"}]}'))
    assert parse_calls(text, NAMES, "mistral") == (
        "Let me check.", [ToolCall("get_weather", PARIS), ToolCall("add", '{"a": [1, {"b": "]"}]}')])


@pytest.mark.parametrize("text", [
    mistral(("get_weather", PARIS), ("launch", "{}")),  # one element names no tool: the whole list is text
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}; {"name": "add", "arguments": {}}]',
    '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}',  # no list
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}',  # the list never closes
    '[TOOL_CALLS] [{"name": ["add"], "arguments": {}}]',
])
def test_a_mistral_marker_followed_by_anything_but_a_list_of_calls_stays_in_the_text(text):
    assert parse_calls(text, NAMES, "mistral") == (text, [])


@pytest.mark.parametrize("text", [
    " Sure. " + mistral(("get_weather", PARIS)) + " and [TOOL_CALLS] [{broken}] [TOOL_CA",
    mistral(("add", '{"a": {"b": {}}}'), ("add", '{"x": "]}"}')) + "\n\n" + mistral(("get_weather", "{}")),
    "no calls here, but a [ and a [TOOL",
    'an unfinished [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"na',
])
def test_a_mistral_stream_in_any_pieces_reassembles_to_the_parse_of_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "mistral")


@pytest.mark.parametrize(("parser", "marker"), [("mistral", "[TOOL_CALLS] "), ("granite", "<|tool_call|>")],
                         ids=["mistral", "granite"])
def test_forced_mistral_and_granite_calls_stream_each_ones_arguments_as_they_arrive(parser, marker):
    text = listed_after(marker, ("add", '{"a": {"b": [1, 2]}, "c": "}"}'), ("get_weather", '{"city": "Oslo"}'))
    content, calls, events = stream_in_pieces(text, progressive=True, rng=random.Random(4), parser=parser)
    assert (content, calls) == parse_calls(text, NAMES, parser)
    assert isinstance(events[0], CallStart) and [e.index for e in events if isinstance(e, CallStart)] == [0, 1]
    assert sum(isinstance(e, ArgumentsDelta) for e in events) > 4


def mistral_by_name(*calls: tuple[str, str]) -> str:
    """Calls as Mistral's v11+ tokenizers write them: each after its own marker, its name before `[ARGS]`."""
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)


def test_mistral_calls_written_by_name_are_calls_and_the_text_before_them_content():
    text = "Let me check. " + mistral_by_name(("get_weather", PARIS), ("add", '{"a": [1, {"b": "]"}]}'))
    assert parse_calls(text, NAMES, "mistral") == (
        "Let me check.", [ToolCall("get_weather", PARIS), ToolCall("add", '{"a": [1, {"b": "]"}]}')])


def test_a_mistral_call_by_name_may_carry_its_id_before_its_arguments():
    text = '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}'
    assert parse_calls(text, NAMES, "mistral") == (None, [ToolCall("add", '{"a": 1}')])


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS]launch[ARGS]{}",  # not one of the request's tools
    '[TOOL_CALLS]add[ARGS]{"a": 1',  # the arguments never close
    '[TOOL_CALLS]add[ARGS]"a=1"',  # arguments not an object
    '[TOOL_CALLS]add{"a": 1}',  # no [ARGS]
    "[TOOL_CALLS]add[CALL_ID]a-b[ARGS]{}",  # an id of other characters than letters and digits
])
def test_a_mistral_marker_followed_by_no_call_by_name_stays_in_the_text(text):
    assert parse_calls(text, NAMES, "mistral") == (text, [])


@pytest.mark.parametrize("text", [
    " Sure. " + mistral_by_name(("get_weather", PARIS), ("add", '{"x": "[ARGS]}"}')) + " Done. [TOOL_CA",
    mistral_by_name(("add", "{}")) + " " + mistral(("get_weather", PARIS)) + "[TOOL_CALLS]ad",
    '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Oslo"}[TOOL_CALLS]launch[ARGS]{}',
    "[TOOL_CALLS]add[CALL_ID]abc[AR",
])
def test_a_stream_of_mistral_calls_by_name_in_any_pieces_reads_as_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "mistral")


def marker_tokenizer() -> Tokenizer:
    """A byte-level vocabulary of 288 tokens whose last is `[TOOL_CALLS]`, a special token (as in Mistral's)."""
    return Tokenizer(train_tokenizer_with_special_tokens("[TOOL_CALLS]"), SpecialTokens(1, (2,), False, None))


def hermes_tag_tokenizer() -> Tokenizer:
    """A byte-level vocabulary whose Hermes tags are special tokens, as some Hermes models' vocabularies make them."""
    return Tokenizer(train_tokenizer_with_special_tokens("<tool_call>", "</tool_call>"),
                     SpecialTokens(1, (2,), False, None))


def v11_tokenizer() -> Tokenizer:
    """A byte-level vocabulary of 288 tokens whose last three are Mistral v11's special `[TOOL_CALLS]`, `[ARGS]` and
    `[CALL_ID]`."""
    return Tokenizer(train_tokenizer_with_special_tokens("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                     SpecialTokens(1, (2,), False, None))


def test_a_format_whose_tag_is_a_special_token_reads_special_tokens_text():
    tokenizer, plain = marker_tokenizer(), Tokenizer(train_tokenizer(300), SpecialTokens(1, (2,), False, None))
    assert special_marker(tokenizer, "mistral") == 287 and tag_token_ids(tokenizer, "mistral") == {287}
    assert special_marker(plain, "mistral") is None and not tag_token_ids(plain, "mistral")
    assert special_marker(tokenizer, "hermes") is None and not tag_token_ids(tokenizer, "hermes")
    assert tag_token_ids(hermes_tag_tokenizer(), "hermes")
    assert not tag_token_ids(hermes_tag_tokenizer(), "llama3_json")
    assert tag_token_ids(v11_tokenizer(), "mistral") == {285, 286, 287}


def read_mistral_stream(texts: list[str]) -> tuple[str | None, list[ToolCall]]:
    """The content and calls a Mistral-format stream reads from the increments' texts, pushed one by one."""
    stream = ToolCalling(NAMES, "mistral").stream()
    return read([event for text in texts for event in stream.push(text)] + stream.finish())


def keeping_special_tokens(tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> StopChecker:
    params = SamplingParams(max_tokens=100, stop=stop, skip_special_tokens=False)
    return StopChecker(params, (2,), tokenizer.decode_stream(skip_special_tokens=params.skip_special_tokens))


def test_a_mistral_call_after_text_held_back_for_a_stop_string_has_its_marker_in_place():
    # "fox" may start the stop string "fox!": it is held back until the marker's text settles it.
    tokenizer = marker_tokenizer()
    reply = "the quick fox" + mistral(("add", '{"a": 1}'))
    checker = keeping_special_tokens(tokenizer, stop=("fox!",))
    texts = [checker.emit(token, None).text for token in tokenizer.encode(reply, add_special_tokens=False)]
    assert "".join(texts) == reply
    assert read_mistral_stream(texts) == ("the quick fox", [ToolCall("add", '{"a": 1}')])


def test_a_mistral_call_whose_increment_ends_mid_character_has_its_marker_in_place():
    # One increment runs from the text before the marker into the first byte of "é" (held back for the next).
    tokenizer = marker_tokenizer()
    reply = "the fox" + mistral(("add", '{"a": "é"}'))
    ids = tokenizer.encode(reply, add_special_tokens=False)
    marker, split = ids.index(287), next(i for i, t in enumerate(ids) if "\ufffd" in tokenizer.token_text(t))
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit_run(run, None)[0] for run in (ids[:marker - 1], ids[marker - 1:split + 1], ids[split + 1:])]
    assert "".join(texts) == reply
    assert read_mistral_stream(texts) == ("the fox", [ToolCall("add", '{"a": "é"}')])


def test_mistral_calls_by_name_whose_tags_are_special_tokens_are_read_from_the_kept_text():
    tokenizer = v11_tokenizer()
    reply = "the fox[TOOL_CALLS]add[CALL_ID]x1y2z3w4v[ARGS]{\"a\": 1}[TOOL_CALLS]get_weather[ARGS]{}"
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit(token, None).text for token in tokenizer.encode(reply, add_special_tokens=False)]
    assert read_mistral_stream(texts) == ("the fox", [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")])


# --- the grammar that forces calls -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(train_tokenizer(300), SpecialTokens(1, (2,), False, None))
    return GrammarCompiler(tokenizer, 300, (2,))


def follows(compiler: GrammarCompiler, grammar: StructuredOutput, text: str) -> bool:
    """Whether `text`, token by token, is a complete output of `grammar` (EOS allowed after it)."""
    matcher = compiler.compile(grammar).matcher
    return all(matcher.consume_token(t) for t in compiler.tokenizer.tokenize_str(text)) and matcher.is_accepting()


ADD = ("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize(("parser", "one", "two"), [
    ("hermes", call("add", '{"a": 1}'), call("add", '{"a": 1}') + "\n" + call("get_weather", "{}")),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}',
     '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'),
    ("mistral", mistral(("add", '{"a": 1}')), mistral(("add", '{"a": 1}'), ("get_weather", "{}"))),
])
def test_the_grammar_takes_calls_in_the_parsers_format_with_arguments_that_follow_the_schema(compiler, parser, one,
                                                                                            two):
    functions = [ADD, ("get_weather", None)]
    assert follows(compiler, call_grammar(functions, parallel=False, parser=parser), one)
    assert not follows(compiler, call_grammar(functions, parallel=False, parser=parser), two)
    assert follows(compiler, call_grammar(functions, parallel=True, parser=parser), two)
    assert not follows(compiler, call_grammar(functions, parallel=True, parser=parser), one.replace("1", '"1"'))
    assert not follows(compiler, call_grammar(functions, parallel=True, parser=parser), one.replace("{", "{ ", 1))


def test_the_grammar_closes_objects_that_say_nothing_of_other_properties(compiler):
    grammar = call_grammar([ADD], parallel=False)
    assert not follows(compiler, grammar, call("add", '{"a": 1, "b": 2}'))
    opened = ("add", {**ADD[1], "additionalProperties": True})
    assert follows(compiler, call_grammar([opened], parallel=False), call("add", '{"a": 1, "b": 2}'))


@pytest.mark.parametrize("parameters", [
    {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"properties": {"b": {"type": "integer"}}}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}, {"required": ["c"]}]},
])
def test_the_grammar_takes_properties_a_schema_spreads_over_its_parts(compiler, parameters):
    # Closing each part alone would refuse the properties the other parts name (or compile to nothing at all).
    grammar = call_grammar([("add", parameters)], parallel=False)
    assert any(follows(compiler, grammar, call("add", arguments)) for arguments in ('{"a": 1, "b": 2}', '{"b": 2, "a": 1}'))


BASE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
EXTRA = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}


@pytest.mark.parametrize("parameters", [
    {"type": "object", "$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}, EXTRA]},
    {"type": "object", "definitions": {"base": BASE}, "allOf": [EXTRA, {"$ref": "#/definitions/base"}]},
    {"type": "object", "$defs": {"base": BASE}, "$ref": "#/$defs/base", **EXTRA},
    {"type": "object", "$defs": {"base": {"$ref": "#/$defs/root"}, "root": BASE},
     "allOf": [{"$ref": "#/$defs/base"}, EXTRA]},
])
def test_the_grammar_takes_properties_a_schema_spreads_over_a_ref_and_its_own(compiler, parameters):
    # The $ref's target is a part of the object as an allOf part is: closed, it would refuse `b`.
    grammar = call_grammar([("add", parameters)], parallel=False)
    assert any(follows(compiler, grammar, call("add", arguments)) for arguments in ('{"a": 1, "b": 2}', '{"b": 2, "a": 1}'))


def test_a_ref_target_used_alone_is_still_closed(compiler):
    parameters = {"type": "object", "$defs": {"base": BASE}, "properties": {"x": {"$ref": "#/$defs/base"}},
                  "required": ["x"]}
    grammar = call_grammar([("add", parameters)], parallel=False)
    assert follows(compiler, grammar, call("add", '{"x": {"a": 1}}'))
    assert not follows(compiler, grammar, call("add", '{"x": {"a": 1, "c": 2}}'))


def test_each_branch_of_a_union_is_still_closed(compiler):
    union = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                       {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert follows(compiler, call_grammar([("add", union)], parallel=False), call("add", '{"a": 1}'))
    assert not follows(compiler, call_grammar([("add", union)], parallel=False), call("add", '{"a": 1, "c": 2}'))


@pytest.mark.parametrize("parameters", [{}, {"properties": {"a": {"type": "integer"}}}])
def test_the_grammar_takes_only_an_object_as_arguments_where_the_schema_allows_any_value(compiler, parameters):
    # A call whose arguments are no object is no call: the forced reply would come back as text.
    grammar = call_grammar([("add", parameters)], parallel=False)
    assert follows(compiler, grammar, call("add", '{"a": 1}'))
    assert not follows(compiler, grammar, call("add", '"a=1"'))


def test_the_mistral_grammar_writes_a_special_marker_as_its_token():
    tokenizer = marker_tokenizer()
    compiler = GrammarCompiler(tokenizer, 288, (2,))
    grammar = call_grammar([ADD], parallel=False, parser="mistral", marker_id=special_marker(tokenizer, "mistral"))
    matcher = compiler.compile(grammar).matcher
    reply = tokenizer.encode(mistral(("add", '{"a": 1}')), add_special_tokens=False)
    assert reply[0] == 287 and all(matcher.consume_token(t) for t in reply) and matcher.is_accepting()
    spelled = compiler.compile(grammar).matcher
    assert not spelled.consume_token(tokenizer.encode("[", add_special_tokens=False)[0])


def test_the_mistral_grammar_of_a_v11_vocabulary_writes_calls_by_name_and_its_reader_takes_them_back():
    """A vocabulary with `[ARGS]` as a special token is Mistral's v11 or later: its models write
    `[TOOL_CALLS]name[ARGS]{...}`, one call per marker, and a forced call is written so too."""
    tokenizer = v11_tokenizer()
    assert args_token(tokenizer, "mistral") is not None and args_token(tokenizer, "hermes") is None
    compiler = GrammarCompiler(tokenizer, 288, (2,))
    two = '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{}'

    def grammar(parallel: bool) -> StructuredOutput:
        return call_grammar([ADD, ("get_weather", None)], parallel=parallel, parser="mistral",
                            marker_id=special_marker(tokenizer, "mistral"), args_id=args_token(tokenizer, "mistral"))

    def takes(parallel: bool, text: str) -> bool:
        matcher = compiler.compile(grammar(parallel)).matcher
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert takes(True, two) and not takes(False, two) and takes(False, two[:two.index("}") + 1])
    assert not takes(True, '[TOOL_CALLS]add[ARGS]{"a": "1"}') and not takes(True, '[TOOL_CALLS] [{"name": "add"')
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit(token, None).text for token in tokenizer.encode(two, add_special_tokens=False)]
    assert read_mistral_stream(texts) == (None, [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")])


# With strict tools under tool_choice auto the model may answer in text, or call; a call follows its schema.
PROSE = "It is sunny in Paris, {as always} <b>today</b>."


@pytest.mark.parametrize(("parser", "one", "two"), [
    ("hermes", "Let me look.\n" + call("add", '{"a": 1}'),
     call("add", '{"a": 1}') + "\n" + call("get_weather", "{}")),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}',
     '\n{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'),
    ("mistral", "Let me look. " + mistral(("add", '{"a": 1}')), mistral(("add", '{"a": 1}'), ("get_weather", "{}"))),
])
def test_under_auto_the_grammar_takes_any_text_or_calls_that_follow_the_schema(compiler, parser, one, two):
    def grammar(parallel: bool) -> StructuredOutput:
        return call_grammar([ADD, ("get_weather", None)], parallel=parallel, parser=parser, after_text=True)

    for text in ("", PROSE, "Ok.\n\nDone", one):
        assert follows(compiler, grammar(False), text), text
    assert follows(compiler, grammar(True), two) and not follows(compiler, grammar(False), two)
    # Once the calls begin, the arguments follow the schema, and the name is one of the tools'.
    assert not follows(compiler, grammar(True), one.replace("1", '"1"'))
    assert not follows(compiler, grammar(True), one.replace('"add"', '"launch"'))
    assert not follows(compiler, grammar(True), one + " and more text")


def test_under_auto_text_and_then_calls_opened_by_a_special_token_follow_the_schema():
    for tokenizer, text, bad in [
            (marker_tokenizer(), "Let me look. " + mistral(("add", '{"a": 1}')), mistral(("add", '{"a": "1"}'))),
            (v11_tokenizer(), "Let me look. " + mistral_by_name(("add", '{"a": 1}'), ("get_weather", "{}")),
             mistral_by_name(("add", '{"b": 1}')))]:
        grammar = call_grammar([ADD, ("get_weather", None)], parallel=True, parser="mistral", after_text=True,
                               marker_id=special_marker(tokenizer, "mistral"), args_id=args_token(tokenizer, "mistral"))
        compiler = GrammarCompiler(tokenizer, 288, (2,))
        for reply, valid in [(PROSE, True), (text, True), (bad, False)]:
            matcher = compiler.compile(grammar).matcher
            ids = tokenizer.encode(reply, add_special_tokens=False)
            assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) == valid, reply


@pytest.mark.parametrize(("vocabulary", "parser", "opened"), [
    (hermes_tag_tokenizer, "hermes", call("add", '{"a": "1"}')),
    (marker_tokenizer, "mistral", mistral(("add", '{"a": "1"}'))),
    (v11_tokenizer, "mistral", mistral_by_name(("add", '{"a": "1"}'))),
])
def test_under_auto_a_special_tag_spelled_in_text_opens_no_call_the_grammar_does_not_hold(vocabulary, parser, opened):
    """Where a special token opens the calls, the text before them is free but for that tag spelled out in
    ordinary tokens: the reader would take it for a call, whose arguments the grammar never held to the schema."""
    tokenizer = vocabulary()
    reply = "Sure. " + opened
    assert parse_calls(reply, frozenset({"add"}), parser)[1] == [ToolCall("add", '{"a": "1"}')]
    grammar = call_grammar([ADD], parallel=True, parser=parser, marker_id=special_marker(tokenizer, parser),
                           args_id=args_token(tokenizer, parser), tag_ids=hermes_tags(tokenizer, parser),
                           after_text=True)
    matcher = GrammarCompiler(tokenizer, tokenizer.vocab_size, (2,)).compile(grammar).matcher
    spelled = [t for character in reply for t in tokenizer.encode(character, add_special_tokens=False)]
    assert not (all(matcher.consume_token(t) for t in spelled) and matcher.is_accepting())


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(("parser", "one"), [("hermes", call("add", '{"a": 1}')),
                                             ("mistral", mistral(("add", '{"a": 1}')))])
def test_under_auto_with_a_json_response_format_the_grammar_takes_the_answer_or_calls(compiler, parser, one):
    grammar = call_grammar([ADD], parallel=False, parser=parser, answer_schema=ANSWER)
    assert follows(compiler, grammar, '{"city": "Paris"}') and follows(compiler, grammar, one)
    for refused in ('{"town": "Paris"}', '{"city": "Paris"} ' + one, PROSE, one.replace("1", '"1"')):
        assert not follows(compiler, grammar, refused), refused


def test_under_auto_with_a_json_response_format_calls_opened_by_a_special_token_are_taken_too():
    tokenizer = marker_tokenizer()
    grammar = call_grammar([ADD], parallel=True, parser="mistral", marker_id=special_marker(tokenizer, "mistral"),
                           answer_schema=ANSWER)
    compiler = GrammarCompiler(tokenizer, 288, (2,))
    for reply, valid in [('{"city": "Paris"}', True), (mistral(("add", '{"a": 1}'), ("add", '{"a": 2}')), True),
                         (PROSE, False)]:
        matcher = compiler.compile(grammar).matcher
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert (all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()) == valid, reply


def test_where_hermes_tags_are_special_tokens_the_grammar_writes_calls_with_them_forced_or_chosen():
    tokenizer = hermes_tag_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, (2,))
    tags = hermes_tags(tokenizer, "hermes")
    assert tags is not None and hermes_tags(tokenizer, "mistral") is None
    assert hermes_tags(marker_tokenizer(), "hermes") is None
    one, two = call("add", '{"a": 1}'), call("add", '{"a": 1}') + "\n" + call("add", '{"a": 2}')

    def takes(after_text: bool, reply: str, spelled: bool = False) -> bool:
        grammar = call_grammar([ADD], parallel=True, tag_ids=tags, after_text=after_text)
        matcher = compiler.compile(grammar).matcher
        pieces = list(reply) if spelled else [reply]  # spelled: a character at a time, the tags as text
        ids = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert tokenizer.encode(one, add_special_tokens=False)[0] == tags[0]
    assert takes(False, one) and takes(False, two) and not takes(False, one, spelled=True)
    assert takes(True, "Let me add. " + two) and takes(True, PROSE)
    assert not takes(True, "Let me add. " + call("add", '{"a": "1"}'))


def strict_request(strict: bool = True, **fields) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "add", "parameters": ADD[1], "strict": strict}}
    other = {"type": "function", "function": {"name": "get_weather"}}
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [tool, other], **fields})


@pytest.mark.parametrize(("fields", "held"), [
    ({}, True),
    ({"tool_choice": "auto"}, True),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}}, True),
    ({"strict": False}, False),
    ({"tool_choice": "none"}, False),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}}, False),
    ({"tool_choice": "required"}, False),  # forced: held by the forcing grammar
    ({"response_format": {"type": "json_object"}}, False),
    ({"allowed_token_ids": [1, 2]}, False),
    ({"min_tokens": 3}, False),
    ({"ignore_eos": True}, False),
])
def test_a_grammar_holds_the_calls_the_model_chooses_where_a_tool_it_may_call_is_strict_and_nothing_else_binds(
        fields, held):
    assert strict_request(**fields).holds_chosen_calls() is held


@pytest.mark.parametrize(("fields", "parser", "field", "kind"), [
    ({"tool_choice": "required"}, "hermes", "tool_choice", "forced"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "hermes", "tool_choice", "forced"),
    ({}, "hermes", None, None),
    ({"strict": True}, "hermes", "tools", "after text"),
    ({"strict": True}, "hermes-tags", "tools", "after text"),  # its tags written as their special tokens
    ({"response_format": {"type": "json_object"}}, "mistral", "response_format", "answer"),
    ({"response_format": {"type": "json_object"}, "strict": True}, "hermes", "response_format", "answer"),
    ({"response_format": {"type": "json_object"}}, "llama3_json", None, None),
    ({"response_format": {"type": "json_object"}, "tool_choice": "none"}, "hermes", None, None),
])
def test_the_calls_grammar_a_request_gets(fields, parser, field, kind):
    strict = fields.pop("strict", False)
    tokenizer = hermes_tag_tokenizer() if parser == "hermes-tags" else marker_tokenizer()
    body = strict_request(strict, **fields)
    held = calls_grammar(body, body.callable_tools(), parser.removesuffix("-tags"), tokenizer)
    assert (held and held[1]) == field
    if kind is not None:
        grammar = held[0].source
        assert ("answer: %json" in grammar) == (kind == "answer") and ("TEXT" in grammar) == (kind == "after text")


# --- rendering the conversation -----------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template with tools of its own, shaped as Qwen's: tools listed first, a call's arguments a dict.
NATIVE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
          "{% for m in messages %}{{ m.role }}: {{ m.content }}"
          "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
          "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}|{% endfor %}")
CONVERSATION = ChatCompletionRequest.model_validate({
    "messages": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                       "function": {"name": "get_weather", "arguments": PARIS}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                 {"role": "tool", "tool_call_id": "call_2", "content": "rain"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
})

# Shaped as Mistral-7B-Instruct-v0.3's: tools before the last user turn, calls as a list after `[TOOL_CALLS]`, and
# call ids that must be nine letters or digits.
MISTRAL = (
    "{% set last_user = (messages | selectattr('role', 'equalto', 'user') | list)[-1] %}{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and m == last_user %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'system' %}{{ m.content }}\n\n"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{{ ', ' if not loop.last else ']' + eos_token }}{% endfor %}"
    "{% elif m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}"
    "[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


def with_template(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), SpecialTokens(None, (), False, template))


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_calls_and_results_as_text():
    tokenizer = with_template(CHATML)
    assert not renders_tools(tokenizer)
    text = chat_prompt(tokenizer, CONVERSATION.messages, tools=CONVERSATION.tools).text
    system, question, calls, results = text.split("<|im_end|>\n")[:4]
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in system
    assert calls == '<|im_start|>assistant\n' + call("get_weather", PARIS)
    assert results == "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"


def test_a_template_with_tools_renders_them_itself_with_arguments_as_a_dict():
    tokenizer = with_template(NATIVE)
    assert renders_tools(tokenizer)
    text = chat_prompt(tokenizer, CONVERSATION.messages, tools=CONVERSATION.tools).text
    assert text == ("TOOLS:get_weather;|user: Weather in Paris?|assistant: CALL get_weather Paris|"
                    "tool: 18 C (for call_1)|tool: rain (for call_2)|")


def test_with_the_mistral_format_call_ids_reach_the_template_as_nine_letters_or_digits():
    tokenizer = with_template(MISTRAL)
    assert renders_tools(tokenizer)
    text = chat_prompt(tokenizer, CONVERSATION.messages, tools=CONVERSATION.tools, call_format="mistral").text
    first, second = mistral_call_id("call_1"), mistral_call_id("call_2")
    assert ('[INST] Weather in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
            f'"id": "{first}"}}]') in text
    assert f'"call_id": "{first}"' in text and f'"call_id": "{second}"' in text
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in (first, second))


def test_distinct_call_ids_become_distinct_mistral_ids_and_one_already_of_nine_stays():
    ids = ["1", "01", "001", "call_1", "call-1", "toolu_x-y", "toolux_y", "x" * 30 + "123456789", "123456789",
           "Ünï_1", "_1"]
    mapped = [mistral_call_id(call_id) for call_id in ids]
    assert len(set(mapped)) == len(ids)
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in mapped)
    assert mapped == [mistral_call_id(call_id) for call_id in ids]  # a tool result finds its call's id again
    assert mistral_call_id("a1B2c3D4e") == "a1B2c3D4e"


def test_calls_whose_ids_differ_only_in_padding_each_keep_their_result_in_the_mistral_template():
    ask = {"role": "user", "content": "Weather in Paris and Oslo?"}
    calls = [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
             for call_id in ("1", "01")]
    conversation = ChatCompletionRequest.model_validate({
        "messages": [ask, {"role": "assistant", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "1", "content": "18 C"},
                     {"role": "tool", "tool_call_id": "01", "content": "rain"}],
        "tools": CONVERSATION.tools})
    text = chat_prompt(with_template(MISTRAL), conversation.messages, tools=conversation.tools,
                       call_format="mistral").text
    ids = re.findall(r'"id": "(\w+)"', text)
    results = re.findall(r'"content": "([^"]*)", "call_id": "(\w+)"', text)
    assert len(set(ids)) == 2 and results == [("18 C", ids[0]), ("rain", ids[1])]


def test_auto_reads_the_format_the_template_writes_and_hermes_where_the_template_has_no_tools():
    assert tool_call_format("auto", with_template(MISTRAL)) == "mistral"
    assert tool_call_format("mistral", with_template(CHATML)) == "hermes"
    assert tool_call_format("auto", with_template(NATIVE + "{# calls follow <|python_tag|> #}")) == "llama3_json"
    assert tool_call_format("auto", with_template(NATIVE)) == "hermes"
    assert tool_call_format("llama3_json", with_template(NATIVE)) == "llama3_json"
    assert tool_call_format("llama3_json", with_template(CHATML)) == "hermes"


# --- the openai client against a real server ---------------------------------------------------------------

MODEL = "smollm2-tools"
# Room for the tools prompt (about 200 tokens with three functions) and n=20 replies sharing its pages.
FLAGS = ["--skip-server-warmup", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
         "--kv-cache-memory", "96MiB", "--api-key", API_KEY, "--served-model-name", MODEL,
         "--tool-call-parser", "auto", "--no-ui"]


def function(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# String lengths are bounded: at temperature 0.8 the 135M model otherwise may write a name until max_tokens (a
# valid prefix, but no call).
NAME = {"type": "string", "maxLength": 24}
WEATHER = function("get_weather", "The current weather of a city", {
    "type": "object",
    "properties": {"city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
})
BOOK = function("book_trip", "Books a trip", {
    "type": "object",
    "properties": {
        "traveller": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                      "required": ["name", "age"]},
        "to": {"type": "object", "properties": {"city": NAME, "nights": {"type": "integer"}},
               "required": ["city", "nights"]},
    },
    "required": ["traveller", "to"],
})
SHOP = function("add_to_cart", "Adds items to the shopping cart", {
    "type": "object",
    "properties": {"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}},
    "required": ["items"],
})
TOOLS = [WEATHER, BOOK, SHOP]

SCHEMA = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = {"get_weather": "What is the weather in Paris?", "book_trip": "Book me, Ann, 34, three nights in Rome.",
       "add_to_cart": "Put apples and pears in my cart."}


@pytest.fixture(scope="module")
def client():
    with openai_client(*FLAGS) as client:
        yield client


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMA))
def test_required_tool_choice_gives_arguments_valid_for_each_schema_in_all_20_samples(client, name):
    tool = next(tool for tool in TOOLS if tool["function"]["name"] == name)
    reply = client.chat.completions.create(model=MODEL, messages=user(ASK[name]), tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.8, n=20, seed=7, max_tokens=200)
    assert len(reply.choices) == 20
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        [tool_call] = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        assert tool_call.function.name == name
        jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMA[name])


@pytest.mark.slow
def test_required_with_parallel_calls_may_call_several_tools_each_valid(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("Weather in Oslo, and add milk to my cart."),
                                           tools=TOOLS, tool_choice="required", temperature=0.8, seed=3, n=4,
                                           max_tokens=200)
    for choice in reply.choices:
        assert choice.message.tool_calls, choice.message.content
        for tool_call in choice.message.tool_calls:
            jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMA[tool_call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", TOOL_CHOICES)
def test_streamed_deltas_reassemble_to_the_unstreamed_calls_at_temperature_0(client, tool_choice):
    # Room for the longest call the schemas allow (4 names of 24 characters, a token each at worst), so a forced
    # call always completes.
    assert_streamed_deltas_reassemble_to_the_unstreamed_reply(
        client, tool_choice != "auto", model=MODEL, messages=user("What is the weather in Paris?"), tools=TOOLS,
        tool_choice=tool_choice, temperature=0, max_tokens=200)


@pytest.mark.slow
def test_a_round_trip_call_result_and_final_answer(client):
    messages = user("What is the weather in Paris? Answer in celsius.")
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    [tool_call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"temperature": 31})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert "31" in answer.message.content  # the result reached the model


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice"),
    ({"tools": [function("f", "bad", {"type": "object", "properties": {"a": {"type": "banana"}}})]},
     "tools.0.function.parameters"),
    ({"tools": [function("f", "bad", {"type": "object", "required": "a"})], "tool_choice": "none"},
     "tools.0.function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_fields_are_400_in_openai_shape(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, **fields)
    error = caught.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
