"""Tool calling's text format: how tools are described to a model whose template has no tool support, how its
calls are written, the grammar that forces them, and the parser that takes them back out of the text.

One format so far, Hermes (Qwen and NousResearch Hermes use it natively): each call is a JSON object on its
own between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is only a call if its JSON parses, names a function of the request, has an object as `arguments` and is
followed by the closing tag; anything else stays in the message's text, so no text the model wrote is lost. The
arguments string returned is the model's own JSON text for them (what it sampled; re-serialized only when it
wrote them before the name), so streamed fragments join to the same string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sluice.batching.sampling_params import StructuredOutput

# `--tool-call-parser` values; "auto" is the format the model's template speaks (`app/prompts.py`).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
# What separates forced parallel calls, by format.
_SEPARATOR = {"hermes": "\n", "llama3_json": "; "}

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# What a call starts with when written as the prompt asks and the grammar forces: its name, then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
# The same fixed JSON layout as structured output's (batching/structured.py): free whitespace lets a small model
# pad with newlines.
_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# Schema keywords whose value maps names to schemas, and those whose value is data rather than a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "x-guidance")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

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
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCalling:
    """What a reply's text is read for: calls of the functions `names`, written in the format `parser`.
    `forced`: a grammar makes the reply nothing but calls, so each one parses and (Hermes) its arguments can
    stream as they are sampled."""

    names: frozenset[str]
    parser: str = "hermes"
    forced: bool = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's text (all but the calls, stripped; None if empty) and its calls, in order: the stream
        given the whole text at once, so a stream and its whole text always read the same."""
        stream = self.stream()
        events = stream.push(text) + stream.finish()
        content = "".join(event.text for event in events if isinstance(event, TextDelta))
        calls = [ToolCall(event.name, arguments.text) for event, arguments in zip(events, events[1:])
                 if isinstance(event, CallStart)]
        return content or None, calls

    def stream(self) -> CallStream | JsonCallStream:
        if self.parser == "llama3_json":
            return JsonCallStream(self.names)
        return CallStream(self.names, progressive=self.forced)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- writing: the prompt and past calls, for a template without tool support -------------------------------


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text describing `tools` (OpenAI's `{"type": "function", "function": {...}}` each)."""
    return DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def render_call(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def render_results(contents: Iterable[str]) -> str:
    """Tool results as the user turn that answers the calls."""
    return "\n".join(f"<tool_response>\n{content}\n</tool_response>" for content in contents)


# --- forcing: required and named tool_choice ----------------------------------------------------------------


def call_grammar(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool,
                 parser: str = "hermes") -> StructuredOutput:
    """A Lark grammar (llguidance's, with `%json` for each function's arguments) whose every output is one call
    of one of `functions` ((name, parameters schema) each), or with `parallel` several, written as `parser`
    writes them (Hermes: one per line; Llama 3: separated by `; `)."""
    rules = []
    for i, (name, parameters) in enumerate(functions):
        schema = {"x-guidance": _LAYOUT, **_closed(parameters if parameters is not None else NO_ARGUMENTS)}
        quoted = json.dumps(name, ensure_ascii=False)
        if parser == "llama3_json":
            head, tail = f'{{"name": {quoted}, "parameters": ', "}"
        else:
            head, tail = f'{OPEN}\n{{"name": {quoted}, "arguments": ', f"}}\n{CLOSE}"
        rules.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema, ensure_ascii=False)} {json.dumps(tail)}")
    start = f"start: call ({json.dumps(_SEPARATOR[parser])} call)*" if parallel else "start: call"
    choices = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    return StructuredOutput("grammar", "\n".join([start, choices, *rules]) + "\n")


def _closed(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists its properties and says nothing
    of others (OpenAI's strict mode asks it of every schema): otherwise a small model, free to add keys, invents
    them until max_tokens. The arguments still validate against the schema as given."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed(subschema) for name, subschema in value.items()}
        else:
            closed[key] = value if key in _NOT_SCHEMAS else _closed(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


# --- reading: whole texts and streams -------------------------------------------------------------------------


def parse_call(body: str, names: frozenset[str]) -> ToolCall | None:
    """The call written between the tags, or None if `body` is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict):
        return None
    head = _HEAD.match(body)
    if head is not None:
        arguments = body[head.end():body.rindex("}")].rstrip()
        if _loads(arguments) == value["arguments"]:
            return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str, names: frozenset[str], parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """`ToolCalling.parse`: the message's text (stripped; None if empty) and its calls."""
    return ToolCalling(names, parser).parse(text)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = TextDelta | CallStart | ArgumentsDelta


@dataclass
class CallStream:
    """Reads calls out of text that arrives in pieces: text deltas, each call's start (its name), then fragments
    of its arguments. The text deltas join to the text around the calls, stripped.

    After an opening tag, a call is a JSON object (its end found by matching braces outside strings, so a string
    may hold a closing tag) then the closing tag. Whether it is one is known once the object has closed, or
    earlier when what follows the tag cannot be JSON; if it is not, the tag is text and reading goes on after
    it. By default a call goes out whole once its closing tag arrives. With `progressive` (a grammar forced the
    calls, so each one parses), its arguments go out as they are sampled; only a tail that may be the call's
    closing braces and tag is held back.
    """

    names: frozenset[str]
    progressive: bool = False
    calls: int = 0
    _buffer: str = ""
    _in_call: bool = False
    _stripped: _StrippedText = field(default_factory=lambda: _StrippedText())
    _open: tuple[int, int] | None = field(default=None)  # a call going out progressively: (arguments start, sent)
    _end: _ObjectEnd | None = None  # the scan of the call being read

    def push(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer, OPEN)
                    self._text(self._buffer[:len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                self._text(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
            elif not self._read_call(events):
                return events

    def finish(self) -> list[StreamEvent]:
        """What is held back at the end of the text: a call still open is text (unless its arguments were already
        going out), and so is a tag's beginning."""
        events: list[StreamEvent] = []
        while self._in_call and self._open is None:
            self._not_a_call(events)
            events += self.push("")
        if not self._in_call:
            self._text(self._buffer, events)
        self._buffer = ""
        return events

    def _read_call(self, events: list[StreamEvent]) -> bool:
        """Reads the call after an opening tag; False while it is still arriving."""
        if self._end is None:
            self._end = _ObjectEnd()
        end = self._end.find(self._buffer)
        if end is None:
            if self.progressive:
                self._send_arguments(events)
            return False
        rest = self._buffer[end:].lstrip() if end >= 0 else None
        if rest is not None and len(rest) < len(CLOSE) and CLOSE.startswith(rest):
            return False  # the closing tag is arriving
        closed = rest is not None and rest.startswith(CLOSE)
        call = parse_call(self._buffer[:end], self.names) if closed else None
        if self._open is not None:
            self._finish_progressive(call, events)
        elif call is None:
            self._not_a_call(events)
            return True
        else:
            events += [CallStart(self.calls, call.name), ArgumentsDelta(self.calls, call.arguments)]
            self.calls += 1
        self._buffer = rest[len(CLOSE):] if closed else ""
        self._in_call = False
        self._end = None
        return True

    def _not_a_call(self, events: list[StreamEvent]) -> None:
        self._text(OPEN, events)
        self._in_call = False
        self._end = None

    def _text(self, text: str, events: list[StreamEvent]) -> None:
        if out := self._stripped.add(text):
            events.append(TextDelta(out))

    def _send_arguments(self, events: list[StreamEvent]) -> None:
        if self._open is None:
            head = _HEAD.match(self._buffer)
            # The head is complete once something follows its whitespace.
            if head is None or head.end() == len(self._buffer) or head.group(1) not in self.names:
                return
            events.append(CallStart(self.calls, head.group(1)))
            self._open = (head.end(), head.end())
        start, sent = self._open
        visible = len(self._buffer.rstrip("} \t\r\n"))
        if visible > sent:
            events.append(ArgumentsDelta(self.calls, self._buffer[sent:visible]))
            self._open = (start, visible)

    def _finish_progressive(self, call: ToolCall | None, events: list[StreamEvent]) -> None:
        start, sent = self._open
        self._open = None
        if call is not None and len(call.arguments) > sent - start:
            events.append(ArgumentsDelta(self.calls, call.arguments[sent - start:]))
        self.calls += 1


@dataclass
class _StrippedText:
    """Text going out in pieces that join to the whole text stripped: whitespace at the start is dropped, and
    whitespace is held until text follows it."""

    _started: bool = False
    _whitespace: str = ""

    def add(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self._whitespace += text
            return ""
        out = self._whitespace + body if self._started else body.lstrip()
        self._started = True
        self._whitespace = text[len(body):]
        return out


@dataclass
class JsonCallStream:
    """Llama 3's JSON tool calls: a reply that is nothing but calls, `{"name": ..., "parameters": {...}}` each,
    separated by `;` (its template's `<|python_tag|>` is a special token, not in the text). Any other reply is
    text, whole. A reply is known to be text at its first character other than `{`; to be calls only at its end,
    so calls go out then, each whole."""

    names: frozenset[str]
    calls: int = 0
    _buffer: str = ""
    _is_text: bool | None = None
    _stripped: _StrippedText = field(default_factory=lambda: _StrippedText())

    def push(self, text: str) -> list[StreamEvent]:
        if self._is_text is None:
            self._buffer += text
            if not self._buffer.strip():
                return []
            self._is_text = not self._buffer.lstrip().startswith("{")
            if not self._is_text:
                return []
            text, self._buffer = self._buffer, ""
        elif not self._is_text:
            self._buffer += text
            return []
        out = self._stripped.add(text)
        return [TextDelta(out)] if out else []

    def finish(self) -> list[StreamEvent]:
        if self._is_text or not self._buffer.strip():
            return []
        calls = _json_calls(self._buffer, self.names)
        if calls is None:
            return [TextDelta(self._buffer.strip())]
        events: list[StreamEvent] = []
        for call in calls:
            events += [CallStart(self.calls, call.name), ArgumentsDelta(self.calls, call.arguments)]
            self.calls += 1
        return events


def _json_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls `text` consists of (JSON objects separated by `;`), or None if it is anything else."""
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        position = len(text) - len(text[position:].lstrip())
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        arguments = value.get("parameters", value.get("arguments"))
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)))
        rest = text[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        position = len(text) - len(rest) + 1


# Outside strings, JSON has only these characters besides brackets and quotes.
_JSON_OUTSIDE_STRINGS = frozenset(" \t\r\n,:-+.0123456789eEtruefalsn")


@dataclass
class _ObjectEnd:
    """Finds where the JSON object a text starts with (after whitespace) ends, reading the text as it grows: each
    character is looked at once however often `find` is asked."""

    _read: int = 0
    _found: int | None = None
    _started: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def find(self, text: str) -> int | None:
        """The index after the object's closing brace; None while it may still be arriving; -1 if `text` cannot
        begin one. `text` must extend the text of the previous call."""
        if self._found is None:
            self._found = self._scan(text)
        return self._found

    def _scan(self, text: str) -> int | None:
        for i in range(self._read, len(text)):
            char = text[i]
            self._read = i + 1
            if not self._started:
                if char.isspace():
                    continue
                if char != "{":
                    return -1
                self._started = True
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            elif char not in _JSON_OUTSIDE_STRINGS:
                return -1
        return None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be arriving)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
