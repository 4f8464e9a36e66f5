"""Granite 3.x's tool calls (`--tool-call-parser granite`, vLLM's): `<|tool_call|>` (or Granite 3.1's `<tool_call>`)
then a JSON list of `{"name", "arguments"}` objects. The reader on its own, the grammar that forces calls, the
vocabulary whose `<|tool_call|>` is a special token, then the official `openai` client against a real
`sluice serve` with a tiny random model whose template is shaped as Granite's."""

from __future__ import annotations

import pytest

from sluice.app.prompts import chat_prompt, tool_call_format
from sluice.app.tool_call_streams import ToolCall
from sluice.app.tool_calls import ToolCalling, call_grammar, parse_calls, special_marker, tag_token_ids
from sluice.batching.structured import GrammarCompiler
from sluice.model.tokenizer import IncrementalDetokenizer, SpecialTokens, Tokenizer

from hf_folder import train_tokenizer, train_tokenizer_with_special_tokens
from test_tool_calls import (  # noqa: F401 (compiler: a fixture)
    ADD,
    CONVERSATION,
    NAMES,
    NATIVE,
    PARIS,
    assert_any_pieces_read_as_the_whole,
    compiler,
    follows,
    keeping_special_tokens,
    listed_after,
    read,
    with_template,
)
from tool_call_servers import (ASK, CART, TOOL_CHOICES, WEATHER, assert_required_calls_come_back_valid,
                               assert_streamed_deltas_reassemble_to_the_unstreamed_reply,
                               tiny_model_server)

MARKER = "<|tool_call|>"
END_OF_ROLE = "<|end_of_role|>"  # another of Granite's special tokens


def granite(*calls: tuple[str, str], marker: str = MARKER) -> str:
    return listed_after(marker, *calls)


# --- the reader ------------------------------------------------------------------------------------------------


def test_a_granite_list_after_the_marker_is_calls_and_the_text_before_it_content():
    text = "Let me check. " + granite(("get_weather", PARIS), ("add", '{"a": [1, {"b": "]"}]}'))
    assert parse_calls(text, NAMES, "granite") == (
        "Let me check.", [ToolCall("get_weather", PARIS), ToolCall("add", '{"a": [1, {"b": "]"}]}')])


def test_granite_3_1s_tool_call_string_is_a_marker_too():
    text = granite(("add", '{"a": 1}'), marker="<tool_call>\n")
    assert parse_calls(text, NAMES, "granite") == (None, [ToolCall("add", '{"a": 1}')])


@pytest.mark.parametrize("marker", ["<|tool_call|><tool_call>", "<|tool_call|>\n<tool_call> "])
def test_granite_3_1s_tool_call_string_after_the_marker_is_part_of_it(marker):
    # vLLM strips both: a model may write its 3.0 token and then its 3.1 string.
    text = "Sure. " + granite(("add", '{"a": 1}'), marker=marker)
    assert parse_calls(text, NAMES, "granite") == ("Sure.", [ToolCall("add", '{"a": 1}')])


@pytest.mark.parametrize(("text", "content"), [
    ("<|tool_call|>[]", None),
    ("<tool_call> [ \n]", None),
    ("<|tool_call|><tool_call>[]", None),
    ("Nothing to call. <|tool_call|>[] Done.", "Nothing to call.  Done."),
])
def test_an_empty_granite_list_is_no_calls_and_no_text(text, content):
    # As vLLM reads it: tools called, none of them.
    assert parse_calls(text, NAMES, "granite") == (content, [])


@pytest.mark.parametrize("text", [
    '<|tool_call|><tool_call>{"name": "add", "arguments": {}}',  # the marker twice, then no list
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
    'an empty <|tool_call|> [ ] list, and <|tool_call|> <tool_call>[{"name": "add", "arguments": {}}] <|tool_call|><',
])
def test_a_granite_stream_in_any_pieces_reassembles_to_the_parse_of_the_whole_text(text):
    assert_any_pieces_read_as_the_whole(text, "granite")


def test_without_parallel_calls_a_granite_reply_keeps_its_first_call_alone():
    text = granite(("add", "{}"), ("get_weather", PARIS))
    assert ToolCalling(NAMES, "granite", parallel=False).parse(text) == (None, [ToolCall("add", "{}")])


# --- the marker as a special token -----------------------------------------------------------------------------


def granite_tokenizer() -> Tokenizer:
    """A byte-level vocabulary of 288 tokens whose last is `<|tool_call|>`, a special token (as in Granite's)."""
    return Tokenizer(train_tokenizer_with_special_tokens(MARKER), SpecialTokens(1, (2,), False, None))


def test_a_granite_vocabulary_whose_marker_is_a_special_token_reads_special_tokens_text():
    tokenizer, plain = granite_tokenizer(), Tokenizer(train_tokenizer(300), SpecialTokens(1, (2,), False, None))
    assert special_marker(tokenizer, "granite") == 287 and tag_token_ids(tokenizer, "granite") == {287}
    assert special_marker(plain, "granite") is None and not tag_token_ids(plain, "granite")
    assert not tag_token_ids(tokenizer, "mistral")


def test_a_granite_call_after_its_special_marker_is_read_from_the_kept_text():
    tokenizer = granite_tokenizer()
    reply = "the fox" + granite(("add", '{"a": 1}'), ("get_weather", "{}"))
    checker = keeping_special_tokens(tokenizer)
    texts = [checker.emit(token, None).text for token in tokenizer.encode(reply, add_special_tokens=False)]
    stream = ToolCalling(NAMES, "granite").stream()
    events = [event for text in texts for event in stream.push(text)] + stream.finish()
    assert read(events) == ("the fox", [ToolCall("add", '{"a": 1}'), ToolCall("get_weather", "{}")])


@pytest.mark.parametrize("streaming", ["byte_level", "library"])
def test_a_stream_that_keeps_the_markers_text_leaves_out_the_other_special_tokens(streaming):
    tokenizer = Tokenizer(train_tokenizer_with_special_tokens(MARKER, END_OF_ROLE), SpecialTokens(1, (2,), False, None))
    ids = tokenizer.encode(f"{END_OF_ROLE}Sure{END_OF_ROLE} here." + granite(("add", "{}")), add_special_tokens=False)
    kept = frozenset({286})
    stream = (tokenizer.decode_stream(ids[:1], kept_special_ids=kept) if streaming == "byte_level"
              else IncrementalDetokenizer(tokenizer._backend, ids[:1], kept_special_ids=kept))
    assert "".join(stream.push([token]) for token in ids[1:]) + stream.flush() == "Sure here." + granite(("add", "{}"))


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


def granite_turns(template: str) -> list[str]:
    """CONVERSATION (a call, then its result and another's) rendered with `template` in the Granite format, a turn
    each."""
    rendered = chat_prompt(with_template(template), CONVERSATION.messages, tools=CONVERSATION.tools,
                           call_format="granite", add_generation_prompt=False)
    return rendered.text.split("<|end_of_text|>\n")


def test_an_assistants_calls_are_written_as_granite_writes_them_where_its_template_shows_content_alone():
    # Granite's templates write no `tool_calls`: the turn would be empty before the call's result.
    assert '<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}]' in granite_turns(GRANITE)


def test_an_assistants_calls_are_left_to_a_granite_template_that_writes_them():
    template = GRANITE.replace("{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls or [] %}"
                                                  "CALL {{ c.function.name }}{% endfor %}")
    assert "<|start_of_role|>assistant<|end_of_role|>CALL get_weather" in granite_turns(template)


def test_auto_reads_the_granite_format_from_a_template_that_writes_its_marker():
    assert tool_call_format("auto", with_template(GRANITE)) == "granite"


@pytest.mark.parametrize("template", [
    NATIVE + "{# calls as <tool_call>{...}</tool_call>: models trained on <|tool_call|> are not this one #}",
    GRANITE.replace("<|start_of_role|>", "<|im_start|>"),  # the marker without Granite's roles
    GRANITE + "{# calls as <tool_call>{...}</tool_call> #}",  # Granite's roles with Hermes's calls (Granite 4's)
])
def test_auto_reads_no_granite_format_from_a_template_that_only_mentions_its_marker(template):
    assert tool_call_format("auto", with_template(template)) == "hermes"


# --- the openai client against a real server ---------------------------------------------------------------------

MODEL = "tiny-granite"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_model_server(tmp_path_factory, MARKER, GRANITE, "auto", MODEL, END_OF_ROLE) as client:
        yield client


def test_required_calls_in_the_granite_format_come_back_valid(client):
    assert_required_calls_come_back_valid(client, MODEL)


def test_a_reply_with_tools_keeps_the_text_of_the_markers_alone_of_the_special_tokens(client):
    # The marker's text is kept for the reader; another special token's is left out, as without tools.
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=3,
                                           logit_bias={"287": 100})  # the id of END_OF_ROLE, after the marker
    assert reply.choices[0].message.content is None


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES)
def test_streamed_granite_deltas_reassemble_to_the_unstreamed_reply_at_temperature_0(client, tool_choice):
    assert_streamed_deltas_reassemble_to_the_unstreamed_reply(
        client, tool_choice != "auto", model=MODEL, messages=ASK, tools=[WEATHER, CART], tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0, max_tokens=120)
