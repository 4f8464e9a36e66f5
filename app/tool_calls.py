"""Tool calling's text formats: how tools are described to a model whose template has no tool support, how its
calls are written, the grammar that forces them, and which reader (`app/tool_call_streams.py`) takes them back
out of the text.

Four formats (`--tool-call-parser`):

    hermes       <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>   (Qwen, Hermes)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}                         (Llama 3.x)
    mistral      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]           (Mistral)
                 [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                  (Mistral's v11+ tokenizers)
    granite      <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]           (Granite 3.x)

A call is only a call if its JSON parses, names a function of the request and has an object as arguments;
anything else stays in the message's text, so no text the model wrote is lost. Mistral's `[TOOL_CALLS]` is a
special token in Mistral's vocabularies (Granite's `<|tool_call|>` in Granite's, Hermes's `<tool_call>` in some),
whose text the detokenizer leaves out by default: such a request keeps those tokens' text
(`SamplingParams.kept_special_ids`, `tag_token_ids`), so the tag is in the text where its token was. vLLM's Mistral
and Hermes parsers keep every special token's text (`skip_special_tokens` False); Sluice keeps the tags' alone, so
another special token the model writes (Granite's `<|end_of_role|>`, say) stays out of the content, as it does
without tools. A request that asks `skip_special_tokens: false` keeps them all.
"""

from __future__ import annotations

import hashlib
import json
import string
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from sluice.batching.sampling_params import StructuredOutput
from sluice.model.tokenizer import Tokenizer

from sluice.app.tool_call_streams import (
    ARGS,
    ArgumentsDelta,
    GRANITE,
    HERMES,
    MISTRAL,
    CallStart,
    CallStream,
    FirstCallOnly,
    JsonCallStream,
    TextDelta,
    ToolCall,
)

# `--tool-call-parser` values; "auto" is the format the model's template speaks (`app/prompts.py`).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "granite")
OPEN, CLOSE = HERMES.open, HERMES.close
# The tags `CallStream` reads each format's calls between (Llama 3's calls have none).
_SYNTAX = {"hermes": HERMES, "mistral": MISTRAL, "granite": GRANITE}
# The same fixed JSON layout as structured output's (batching/structured.py): free whitespace lets a small model
# pad with newlines.
_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# Schema keywords whose value maps names to schemas, and those whose value is data rather than a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "x-guidance")
# Keywords whose subschemas describe the object that holds them, so their properties join its own: `allOf`'s
# always, the others' where that object has properties of its own (or is itself such a part).
_ALL_PARTS = ("allOf", "dependentSchemas")
_ONE_PART = ("anyOf", "oneOf", "then", "else")
# Keywords whose subschemas test the object rather than describe it: closing one would change what it tests.
_TESTS = ("not", "if")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_ARGUMENTS = {"type": "object"}  # a call the model chooses of a tool that is not strict
_ALPHANUMERIC = string.ascii_letters + string.digits

DEFAULT_TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. Their JSON signatures are between \
<tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments between <tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class _Written:
    """How a format's forced calls are written: `marker` then `before` ahead of the calls, each call as
    `call_head` + `{"name": ..., "<key>": <arguments>}` + `call_tail`, `separator` between two, `after` last."""

    key: str
    separator: str
    call_head: str = ""
    call_tail: str = ""
    marker: str = ""
    before: str = ""
    after: str = ""


_WRITTEN = {
    "hermes": _Written("arguments", "\n", call_head=f"{OPEN}\n", call_tail=f"\n{CLOSE}"),
    "llama3_json": _Written("parameters", "; "),
    # As Mistral's template writes an assistant's calls.
    "mistral": _Written("arguments", ", ", marker=MISTRAL.open, before=" [", after="]"),
    # As Granite's system prompt asks: the marker, then a JSON list.
    "granite": _Written("arguments", ", ", marker=GRANITE.open, before="[", after="]"),
}


def special_marker(tokenizer: Tokenizer, parser: str) -> int | None:
    """The id of the format's marker if the vocabulary holds it as one special token, for the grammar to write
    it as that token."""
    return tokenizer.special_token_id(_WRITTEN[parser].marker)


def hermes_tags(tokenizer: Tokenizer, parser: str) -> tuple[int, int] | None:
    """The ids of `<tool_call>` and `</tool_call>` where the format is Hermes's and the vocabulary holds both as
    special tokens (Hermes 2 Pro's and Hermes 3's Llama vocabularies), for the grammar to write them as those
    tokens."""
    if parser != "hermes":
        return None
    opens, closes = (tokenizer.special_token_id(tag) for tag in (OPEN, CLOSE))
    return None if opens is None or closes is None else (opens, closes)


def args_token(tokenizer: Tokenizer, parser: str) -> int | None:
    """The id of `[ARGS]` where the format is Mistral's and the vocabulary holds it as a special token (Mistral's
    v11 and later tokenizers): their models write calls by name, `[TOOL_CALLS]name[ARGS]{...}`, one per marker."""
    return tokenizer.special_token_id(ARGS) if parser == "mistral" else None


def tag_token_ids(tokenizer: Tokenizer, parser: str) -> frozenset[int]:
    """The ids of the tags the format's reader looks for that are one special token each in this vocabulary
    (Mistral's `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`; Granite's `<|tool_call|>`): their text is in the reply only
    where the detokenizer keeps it (`SamplingParams.kept_special_ids`)."""
    syntax = _SYNTAX.get(parser)
    ids = (tokenizer.special_token_id(tag) for tag in (syntax.tags if syntax is not None else ()))
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class ToolCalling:
    """What a reply's text is read for: calls of the functions `names`, written in the format `parser`.
    `forced`: a grammar makes the reply nothing but calls, so each one parses and (but Llama 3's) its arguments
    can stream as they are sampled. `parallel` False: the reply's first call alone (`parallel_tool_calls: false`)."""

    names: frozenset[str]
    parser: str = "hermes"
    forced: bool = False
    parallel: bool = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's text (all but the calls, stripped; None if empty) and its calls, in order: the stream
        given the whole text at once, so a stream and its whole text always read the same."""
        stream = self.stream()
        events = stream.push(text) + stream.finish()
        content = "".join(event.text for event in events if isinstance(event, TextDelta))
        arguments: dict[int, str] = {}
        for event in events:
            if isinstance(event, ArgumentsDelta):
                arguments[event.index] = arguments.get(event.index, "") + event.text
        calls = [ToolCall(event.name, arguments.get(event.index, ""))
                 for event in events if isinstance(event, CallStart)]
        return content or None, calls

    def stream(self) -> CallStream | JsonCallStream | FirstCallOnly:
        syntax = _SYNTAX.get(self.parser)
        if syntax is None:
            reader = JsonCallStream(self.names, self.forced)
        else:
            reader = CallStream(self.names, syntax, progressive=self.forced)
        return reader if self.parallel else FirstCallOnly(reader)


def parse_calls(text: str, names: frozenset[str], parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """`ToolCalling.parse`: the message's text (stripped; None if empty) and its calls."""
    return ToolCalling(names, parser).parse(text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates require it (nine letters or digits), the same for the assistant's call and
    the tool result that answers it: one that is such an id already stays; any other becomes nine base-62 digits
    of its SHA-256, so that distinct ids stay apart (a conversation's `1` and `01`, say) but for a chance of one
    in 62**9 a pair."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest())
    digits = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        digits.append(_ALPHANUMERIC[digit])
    return "".join(digits)


# --- writing: the prompt and past calls, for a template without tool support -------------------------------


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text describing `tools` (OpenAI's `{"type": "function", "function": {...}}` each)."""
    return DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def render_calls(calls: list[tuple[str, Any]], parser: str = "hermes") -> str:
    """An assistant's past calls ((name, arguments) each) as the format `parser` writes them, the grammar's way:
    for a template that does not write them itself."""
    written = _WRITTEN[parser]
    objects = [written.call_head + json.dumps({"name": name, written.key: arguments}, ensure_ascii=False)
               + written.call_tail for name, arguments in calls]
    return written.marker + written.before + written.separator.join(objects) + written.after


def render_results(contents: Iterable[str]) -> str:
    """Tool results as the user turn that answers the calls."""
    return "\n".join(f"<tool_response>\n{content}\n</tool_response>" for content in contents)


# --- the grammar of calls: forced (required, named), or chosen by the model (auto, strict tools) ---------------


def call_grammar(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool, parser: str = "hermes",
                 marker_id: int | None = None, args_id: int | None = None, tag_ids: tuple[int, int] | None = None,
                 after_text: bool = False, answer_schema: dict[str, Any] | None = None) -> StructuredOutput:
    """A Lark grammar (llguidance's, with `%json` for each function's arguments) whose every output is one call
    of one of `functions` ((name, parameters schema) each), or with `parallel` several, written as `parser`
    writes them (Hermes: one per line; Llama 3: separated by `; `; Mistral: a list after `[TOOL_CALLS]`, or with
    `args_id` each call as `[TOOL_CALLS]name[ARGS]{...}`; Granite: a list after `<|tool_call|>`). `marker_id`,
    `args_id`, `tag_ids`: the marker's, `[ARGS]`'s and Hermes's tags' ids where they are special tokens
    (`special_marker`, `args_token`, `hermes_tags`), written as those tokens. `after_text` (tool_choice auto with
    strict tools): any text instead, or text and then the calls, which the grammar holds from the format's opening
    tag on (Llama 3's, whose calls are the whole reply: from a first character `{`; a special token's, which the
    text never spells: the reader would take that for calls too). `answer_schema` (tool_choice auto with a JSON
    response_format): a JSON answer that follows it instead (not with Llama 3's calls, whose first `{` llguidance
    would read as the answer's or theirs alone)."""
    written = _WRITTEN[parser]
    marker = f"<[{marker_id}]>" if marker_id is not None else json.dumps(written.marker)
    schemas = [json.dumps({"x-guidance": _LAYOUT, "type": "object",
                           # A schema that names no type (`{}`, say) allows any value, but arguments that are
                           # no object are no call.
                           **_closed(parameters if parameters is not None else NO_ARGUMENTS)}, ensure_ascii=False)
               for _, parameters in functions]

    head, tail, opens, closes = written.call_head, "}" + written.call_tail, "", ""
    if tag_ids is not None:
        head, tail = head.removeprefix(OPEN), tail.removesuffix(CLOSE)
        opens, closes = f"<[{tag_ids[0]}]> ", f" <[{tag_ids[1]}]>"

    def choice(rule: str, lead: str) -> list[str]:
        """`rule`: a call of any of the functions, `lead` before each one's `{"name": ...`."""
        if args_id is not None:
            rules = [f"{rule}_{i}: {marker} {json.dumps(name, ensure_ascii=False)} <[{args_id}]> %json {schema}"
                     for i, ((name, _), schema) in enumerate(zip(functions, schemas))]
        else:
            rules = [f"{rule}_{i}: {opens}"
                     + json.dumps(f'{lead}{{"name": {json.dumps(name, ensure_ascii=False)}, "{written.key}": ')
                     + f" %json {schema} {json.dumps(tail)}{closes}"
                     for i, ((name, _), schema) in enumerate(zip(functions, schemas))]
        return [f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(len(functions))), *rules]

    def block(first: str, opening: str) -> str:
        """The calls (`first`, then `call`s) after `opening` (the marker, or '""' where text took it), with the
        format's text around them."""
        if args_id is not None:
            return f"{first} call*" if parallel else first
        calls = f"{first} ({json.dumps(written.separator)} call)*" if parallel else first
        return " ".join(t for t in [opening, json.dumps(written.before), calls, json.dumps(written.after)] if t != '""')

    rules = choice("call", head)
    any_text = "/(.|\\n)*/"
    text = f"TEXT: {any_text}"
    tag = json.dumps(written.marker or OPEN)  # what the format's reader takes to open calls
    lazy = f"start: TEXT | head opened\nhead[lazy]: TEXT {tag}"
    if answer_schema is not None:
        answer = json.dumps({"x-guidance": _LAYOUT, **answer_schema}, ensure_ascii=False)
        start = f"start: answer | {block('call', marker)}\nanswer: %json {answer}"
    elif not after_text:
        start = f"start: {block('call', marker)}"
    elif (marker_id, args_id, tag_ids) != (None, None, None):  # a special token opens the calls, never in text
        # Nor their tag spelled in text, which the reader would take for calls the grammar does not hold.
        untagged = f"TEXT: {any_text} & ~({any_text} {tag} {any_text})"
        start, rules = f"start: TEXT | TEXT {block('call', marker)}", [*rules, untagged]
    elif parser == "llama3_json":  # text is a reply that is not calls: its first character is no `{`
        start = rf"start: /\s*([^{{\s](.|\n)*)?/ | /\s*/ {block('call', marker)}"
    elif written.marker:  # the text ends at the first marker (lazy)
        start, rules = lazy, [*rules, "opened: " + block("call", '""'), text]
    else:  # Hermes: the text ends at the first call's tag (lazy), and that call goes on without it
        first = choice("first", head.removeprefix(OPEN))
        start, rules = lazy, [*rules, *first, "opened: " + block("first", marker), text]
    return StructuredOutput("grammar", "\n".join([start, *rules]) + "\n", mostly_free=after_text)


def _closed(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists its properties and says nothing
    of others (OpenAI's strict mode asks it of every schema): otherwise a small model, free to add keys, invents
    them until max_tokens. The arguments still validate against the schema as given.

    An object whose properties are spread over several subschemas (`allOf`, or properties beside `anyOf`, `oneOf`,
    `then`/`else`, `dependentSchemas` or `$ref`) is left open, and so is each part, a `$ref`'s target included:
    closing one part would refuse the properties the others name, and the grammar would refuse arguments the
    schema allows (or compile to nothing). `not` and `if` are left as given: closing them would change what they
    test. A target found to be a part may hold a `$ref` that makes another one a part: passes run until none is
    found anew."""
    parts = _Parts(frozenset())
    while True:
        closed = _close(schema, "#", False, parts)
        if parts.found <= parts.opened:
            return closed
        parts = _Parts(parts.opened | parts.found)


@dataclass
class _Parts:
    """The `$ref` targets (JSON pointers into the schema, `#/$defs/base`) that are parts of an object: `opened`,
    those left open in this pass; `found`, those it found."""

    opened: frozenset[str]
    found: set[str] = field(default_factory=set)


def _close(schema: Any, at: str, part: bool, parts: _Parts) -> Any:
    """`_closed` of the subschema at the JSON pointer `at`; `part`: whether it is a part of an object."""
    if isinstance(schema, list):
        return [_close(item, f"{at}/{i}", part, parts) for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    part = part or at in parts.opened
    joined = part or "properties" in schema or "patternProperties" in schema or "allOf" in schema
    if joined and isinstance(schema.get("$ref"), str):
        parts.found.add(unquote(schema["$ref"]))
    closed = {}
    for key, value in schema.items():
        here = f"{at}/{_pointer_token(key)}"
        if key in _NOT_SCHEMAS or key in _TESTS:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _close(subschema, f"{here}/{_pointer_token(name)}", key in _ALL_PARTS, parts)
                           for name, subschema in value.items()}
        else:
            closed[key] = _close(value, here, key in _ALL_PARTS or (key in _ONE_PART and joined), parts)
    spread = part or any(key in schema for key in (*_ALL_PARTS, *_ONE_PART, "$ref"))
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema and not spread:
        closed["additionalProperties"] = False
    return closed


def _pointer_token(key: str) -> str:
    """`key` as a JSON pointer writes it (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
