"""Reading tool calls out of a reply's text as it arrives: text deltas, each call's start (its name), then
fragments of its arguments. `tool_calls.ToolCalling` picks the reader of the request's format; a whole text is
read by the same reader given it at once, so a stream and its whole text always read the same.

Two readers. `CallStream` reads calls between an opening tag and a close, with a JSON object per call: Hermes
(`<tool_call>{...}</tool_call>`, one call per tag), Mistral (`[TOOL_CALLS] [{...}, {...}]`, a list per tag, or
as its v11+ tokenizers write them, `[TOOL_CALLS]name[ARGS]{...}`, one call per tag with no close) and Granite
(`<|tool_call|>[{...}, {...}]`, or Granite 3.1's `<tool_call>[...]`, a list per tag).
`JsonCallStream` reads Llama 3's replies, which are calls only if they are nothing but calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# What a call starts with when written as the prompt asks and the grammar forces: its name, then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
# The head of a call written by name (Mistral's v11+ tokenizers): its name, maybe its id, then its arguments.
CALL_ID, ARGS = "[CALL_ID]", "[ARGS]"
# What Llama 3 may open its calls with (a special token, in the text only where special tokens' text is kept).
PYTHON_TAG = "<|python_tag|>"
_NAMED_HEAD = re.compile(rf"\s*(.*?)(?:{re.escape(CALL_ID)}[A-Za-z0-9]*)?{re.escape(ARGS)}", re.DOTALL)
# A UTF-16 surrogate: a string JSON decoded holds one only where its text escaped it with no pair (`\ud83d`).
SURROGATE = re.compile("[\ud800-\udfff]")
# Outside strings, JSON has only these characters besides quotes.
_JSON_OUTSIDE_STRINGS = frozenset("{}[] \t\r\n,:-+.0123456789eEtruefalsn")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


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


@dataclass(frozen=True)
class CallSyntax:
    """How a format wraps its calls in text: `open` starts a group of calls, JSON objects after `begin`, separated
    by `separator` (None: one call a group) and ended by `close`; whitespace may come between any two.
    `closed_by_end`: the reply's end closes a group as `close` would (a model may stop right after a call's JSON,
    before its close; vLLM's Hermes parser reads such a call). `by_name`: a call may instead follow `open` as its
    name, `[ARGS]` and its arguments (`name[CALL_ID]id[ARGS]{...}` with an id), one call per tag and no close.
    `also_open`: other tags that start a group as `open` does; one right after `open` is part of that tag (vLLM's
    Granite parser strips `<|tool_call|>` then `<tool_call>`). `may_be_empty`: `begin` then `close` is a group of
    no calls, so neither calls nor text (vLLM's Granite parser reads `[]` as no calls and no content)."""

    open: str
    begin: str
    separator: str | None
    close: str
    closed_by_end: bool = False
    by_name: bool = False
    also_open: tuple[str, ...] = ()
    may_be_empty: bool = False

    @property
    def opens(self) -> tuple[str, ...]:
        return (self.open, *self.also_open)

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag the format's reader looks for."""
        return (*self.opens, self.close, *((CALL_ID, ARGS) if self.by_name else ()))


HERMES = CallSyntax("<tool_call>", "", None, "</tool_call>", closed_by_end=True)
MISTRAL = CallSyntax("[TOOL_CALLS]", "[", ",", "]", by_name=True)
# vLLM's `granite` parser: Granite 3.0 writes its `<|tool_call|>` token, Granite 3.1 the text `<tool_call>`.
GRANITE = CallSyntax("<|tool_call|>", "[", ",", "]", also_open=("<tool_call>",), may_be_empty=True)


def parse_call(body: str, names: frozenset[str]) -> ToolCall | None:
    """The call `body` (one JSON object) writes, or None if it is not one: it must name one of `names` and have an
    object as `arguments`. The arguments' text is the model's own (what it sampled), re-serialized only when it
    wrote them before the name, so streamed fragments join to the same string."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not _names_one_of(value, names) or not isinstance(value.get("arguments"), dict):
        return None
    head = _HEAD.match(body)
    if head is not None:
        arguments = body[head.end():body.rindex("}")].rstrip()
        if _loads(arguments) == value["arguments"]:
            return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], _dump_arguments(value["arguments"]))


def _dump_arguments(arguments: dict[str, Any]) -> str:
    """`arguments` as JSON text with their characters as they are (as vLLM's parsers write them), but for a lone
    surrogate (its model's escape had no pair), which no UTF-8 response can carry: that one stays an escape."""
    text = json.dumps(arguments, ensure_ascii=False)
    return SURROGATE.sub(lambda surrogate: f"\\u{ord(surrogate.group()):04x}", text)


def _names_one_of(value: Any, names: frozenset[str]) -> bool:
    """Whether `value` is an object whose `name` is one of `names` (a name the model wrote as a list or an object
    is no name, and unhashable)."""
    return isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"] in names


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class _Group:
    """The calls after an opening tag (`tag`), as far as they have arrived. `position`: where in the reader's
    buffer (the text after the tag) the next part starts; `part`: what is expected there; `calls`: the group's calls read so
    far, held until its close (unless they go out progressively); `name`: a call written by name, the function's;
    `open`: the call whose arguments are going out, as (where its arguments start, how far they went out) in its
    object's text, and `arguments_end` finds where they end; `committed`: calls of the group have gone out, so it is
    no longer text whatever follows."""

    tag: str
    position: int = 0
    # "begin" | "object" | "after" (a separator or the close); "first" (the close or the first object) after the
    # begin of a group that may be empty; by name, "head" then "arguments"
    part: str = "begin"
    calls: list[ToolCall] = field(default_factory=list)
    name: str = ""
    end: _ObjectEnd = field(default_factory=lambda: _ObjectEnd())
    open: tuple[int, int] | None = None
    arguments_end: _ValueEnd | None = None
    committed: bool = False


@dataclass
class CallStream:
    """Reads the calls of a tag-delimited format (`syntax`) out of text that arrives in pieces. The text deltas
    join to the text around the calls, stripped.

    After an opening tag come JSON objects (each one's end found by matching braces outside strings, so a string
    may hold a closing tag) with the format's punctuation. A group is calls once its close has arrived and each
    object is a call (or the reply ends after a call, where the syntax is `closed_by_end`); it is text as soon as
    something else follows the tag (an object that is no call, other punctuation, the reply's end), and reading goes
    on after the tag. By default a group's calls go out when its close arrives. With `progressive` (a grammar
    forced the calls, so each one parses), each call's arguments go out as they are sampled; only a tail that may
    be the object's closing braces is held back, and nothing after the arguments' own end (a key the model wrote
    after them, off the grammar: Mistral's call id, say). An object that turns out no call all the same (text off
    the grammar) leaves its call cut short where it broke, and reading goes on at the object as text.
    """

    names: frozenset[str]
    syntax: CallSyntax = HERMES
    progressive: bool = False
    calls: int = 0  # calls started (their `CallStart` out), one cut short included: the next call's index
    _buffer: str = ""  # text not given out yet: inside a group, the text after its opening tag
    _group: _Group | None = None
    _stripped: _StrippedText = field(default_factory=lambda: _StrippedText())

    def push(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._group is None:
                found = self._first_open()
                if found is None:
                    keep = max(_partial_tag(self._buffer, tag) for tag in self.syntax.opens)
                    self._text(self._buffer[:len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                start, tag = found
                self._text(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(tag):]
                self._group = _Group(tag)
            elif not self._read_group(events):
                return events

    def _first_open(self) -> tuple[int, str] | None:
        """Where in the buffer the first opening tag starts, and which tag it is; None if none has arrived."""
        found = [(start, tag) for tag in self.syntax.opens if (start := self._buffer.find(tag)) >= 0]
        return min(found, default=None)

    def finish(self) -> list[StreamEvent]:
        """What is held back at the end of the text: a group still open is text (unless its calls were already
        going out, the end closes it, or it was cut in a grammar's markup), and so is a tag's beginning (unless a
        grammar was writing it)."""
        events: list[StreamEvent] = []
        if self._group is not None and self._group.open is not None:
            self._send_held_arguments(events)
        while self._group is not None and not self._group.committed:
            if self._closed_by_end():
                self._close(events)
            elif not self._cut_in_forced_markup(events):
                self._abandon(events)
            events += self.push("")
        if self._group is None and not self.progressive:
            self._text(self._buffer, events)
        self._buffer = ""
        return events

    def _read_group(self, events: list[StreamEvent]) -> bool:
        """Reads on in the group until it ends (True) or its next part is still arriving (False): each `_read_*`
        reads one part, False while it is still arriving."""
        readers = {"object": self._read_object, "head": self._read_head, "arguments": self._read_object}
        while self._group is not None:
            if not readers.get(self._group.part, self._read_punctuation)(events):
                return False
        return True

    def _read_punctuation(self, events: list[StreamEvent]) -> bool:
        """The format's text before, between or after the objects."""
        group = self._group
        expected = self._punctuation()
        stripped = self._buffer[group.position:].lstrip()
        if any(len(stripped) < len(e) and e.startswith(stripped) for e in expected):
            return False  # what is expected may be arriving
        matched = next((e for e in expected if stripped.startswith(e)), None)
        if matched is None:
            if group.part == "begin" and self.syntax.by_name:
                group.part = "head"
            elif group.part == "first":
                group.part = "object"
            else:
                self._abandon(events)
            return True
        if matched:  # an empty `begin` (Hermes's) takes no whitespace, however much of it has arrived
            group.position = len(self._buffer) - len(stripped) + len(matched)
        if group.part == "begin" and matched in self.syntax.also_open:
            return True
        if group.part != "begin" and matched == self.syntax.close:
            self._close(events)
        else:
            group.part = "first" if group.part == "begin" and self.syntax.may_be_empty else "object"
            group.end = _ObjectEnd()
        return True

    def _punctuation(self) -> list[str]:
        """What the group's punctuation may be: `begin` (or right after `open`, nothing read yet, a tag of
        `also_open`, part of it); the close before the first object where a group may be empty; a separator or the
        close after an object."""
        group = self._group
        if group.part == "begin":
            wrapped = self.syntax.also_open if group.tag == self.syntax.open and group.position == 0 else ()
            return [self.syntax.begin, *wrapped]
        if group.part == "first":
            return [self.syntax.close]
        return [e for e in (self.syntax.close, self.syntax.separator) if e is not None]

    def _read_object(self, events: list[StreamEvent]) -> bool:
        """A call's object, or a call by name's arguments (which end its group)."""
        group = self._group
        rest = self._buffer[group.position:]
        end = group.end.find(rest)
        call = self._call(rest[:end]) if end is not None and end >= 0 else None
        if self.progressive and group.part == "object" and call is None:
            # Out as far as the text before the character that ends the object or breaks it, as a character at a
            # time would have sent them: arguments that went out stay out whatever follows, so a call that turns out
            # no call (off the grammar) is the same call, cut short, however the text was split.
            self._send_arguments(rest[:group.end.undecided], events)
        if end is None:
            return False
        if call is None:
            self._abandon(events)
            return True
        self._take(call, events)
        group.position += end
        if group.part == "arguments":
            self._close(events)
        else:
            group.part = "after"
        return True

    def _call(self, text: str) -> ToolCall | None:
        """The call an object's text writes, None if it is none (by name: the arguments' text, an object). A call
        whose arguments go out as they arrive (`progressive`, where its head is the one the grammar writes) is the
        name and arguments as written, whatever the rest of its object says off the grammar (a key after the
        arguments, or one written twice): what went out stays out."""
        if self._group.part == "object":
            call = parse_call(text, self.names)
            head = _HEAD.match(text) if call is not None and self.progressive else None
            if head is None or head.group(1) not in self.names:
                return call
            end = _ValueEnd(head.end()).find(text)  # the object is whole JSON: its arguments' end is in it
            return ToolCall(head.group(1), text[head.end():end].rstrip())
        arguments = text.strip()
        return ToolCall(self._group.name, arguments) if isinstance(_loads(arguments), dict) else None

    def _read_head(self, events: list[StreamEvent]) -> bool:
        """A call by name's head: a function's name, maybe an id, then `[ARGS]`."""
        group = self._group
        rest = self._buffer[group.position:]
        head = _NAMED_HEAD.match(rest)
        if head is None and _may_begin_head(rest, self.names):
            return False
        if head is None or head.group(1) not in self.names:
            self._abandon(events)
            return True
        group.name = head.group(1)
        group.position += head.end()
        group.part = "arguments"
        group.end = _ObjectEnd()
        return True

    def _close(self, events: list[StreamEvent]) -> None:
        """The group's calls are complete: out they go, and reading goes on after them."""
        for call in self._group.calls:
            self._emit(call, events)
        self._buffer = self._buffer[self._group.position:]
        self._group = None

    def _cut_in_forced_markup(self, events: list[StreamEvent]) -> bool:
        """Whether the reply, ending in a group none of whose calls went out, was cut (max_tokens, a stop) inside
        the markup a grammar forced (`progressive`): that is no text, and no call but one written by name whose
        arguments began, which goes out cut short as streamed arguments would have."""
        group = self._group
        rest = self._buffer[group.position:]
        if not self.progressive or group.part == "object" and not _may_begin_object_head(rest, self.names):
            return False
        if group.part == "arguments" and rest.strip():
            self._emit(ToolCall(group.name, rest.strip()), events)
        self._group, self._buffer = None, ""
        return True

    def _closed_by_end(self) -> bool:
        """Whether the reply, ending now, ends the group after a call (and whitespace) in a format that takes it."""
        group = self._group
        return self.syntax.closed_by_end and group.part == "after" and not self._buffer[group.position:].strip()

    def _take(self, call: ToolCall, events: list[StreamEvent]) -> None:
        """A call whose object has closed: held for the group's close, or (progressive) out now."""
        group = self._group
        if not self.progressive:
            group.calls.append(call)
            return
        if group.open is None:
            self._emit(call, events)
        else:
            start, sent = group.open
            if len(call.arguments) > sent - start:
                events.append(ArgumentsDelta(self.calls - 1, call.arguments[sent - start:]))
            group.open = None
        group.committed = True

    def _emit(self, call: ToolCall, events: list[StreamEvent]) -> None:
        events += [CallStart(self.calls, call.name), ArgumentsDelta(self.calls, call.arguments)]
        self.calls += 1

    def _send_arguments(self, text: str, events: list[StreamEvent]) -> None:
        """Sends what has arrived of the arguments of the call being sampled (`text`: its object so far)."""
        group = self._group
        if group.open is None:
            head = _HEAD.match(text)
            # The head is complete once something follows its whitespace.
            if head is None or head.end() == len(text) or head.group(1) not in self.names:
                return
            events.append(CallStart(self.calls, head.group(1)))
            self.calls += 1
            group.open, group.arguments_end = (head.end(), head.end()), _ValueEnd(head.end())
            group.committed = True
        start, sent = group.open
        end = group.arguments_end.find(text)
        visible = len(text.rstrip("} \t\r\n")) if end is None else len(text[:end].rstrip())
        if visible > sent:
            events.append(ArgumentsDelta(self.calls - 1, text[sent:visible]))
            group.open = (start, visible)

    def _send_held_arguments(self, events: list[StreamEvent]) -> None:
        """The reply ended inside the object of a call whose arguments were going out: the closing braces held back
        (`_send_arguments`) go out too, since the object never closed, none of them was its own (unless the
        arguments ended before them: all of theirs went out)."""
        start, sent = self._group.open
        text = self._buffer[self._group.position:]
        if self._group.arguments_end.find(text) is None and (tail := text[sent:].rstrip()):
            events.append(ArgumentsDelta(self.calls - 1, tail))

    def _abandon(self, events: list[StreamEvent]) -> None:
        """What follows is not calls: the opening tag is text and reading goes on after it; in a group whose calls
        went out already, reading goes on where its calls end."""
        group = self._group
        self._group = None
        if group.committed:
            self._buffer = self._buffer[group.position:]
        else:
            self._text(group.tag, events)

    def _text(self, text: str, events: list[StreamEvent]) -> None:
        if out := self._stripped.add(text):
            events.append(TextDelta(out))


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
    """Llama 3's JSON tool calls: a reply that is nothing but calls, `{"name": ..., "parameters": {...}}` each (or
    `"arguments"`: `_llama3_arguments`), separated by `;` (one may end the last call too), maybe after
    `<|python_tag|>` (a special token, in the text only where a request keeps special tokens' text; vLLM's llama3_json
    parser reads the calls after it too). Any other reply is text, whole, the tag included. A reply is known to be
    text at its first character other than `{` (after the tag); to be calls only at its end, so calls go out then,
    each whole. `forced`: a grammar wrote the calls, so a reply that is not all calls was cut short (max_tokens, a
    stop): its calls are those before the cut, and the rest of its JSON is no text."""

    names: frozenset[str]
    forced: bool = False
    calls: int = 0
    _buffer: str = ""
    _is_text: bool | None = None
    _stripped: _StrippedText = field(default_factory=lambda: _StrippedText())

    def push(self, text: str) -> list[StreamEvent]:
        if self._is_text is None:
            self._buffer += text
            opening = self._buffer.lstrip()
            if PYTHON_TAG.startswith(opening) or not opening.removeprefix(PYTHON_TAG).strip():
                return []  # the tag, or what comes after it, may still be arriving
            self._is_text = not opening.removeprefix(PYTHON_TAG).lstrip().startswith("{")
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
        calls, whole = _json_calls(self._buffer.lstrip().removeprefix(PYTHON_TAG), self.names)
        if not whole and not self.forced:
            return [TextDelta(self._buffer.strip())]
        events: list[StreamEvent] = []
        for call in calls:
            events += [CallStart(self.calls, call.name), ArgumentsDelta(self.calls, call.arguments)]
            self.calls += 1
        return events


@dataclass
class FirstCallOnly:
    """A reader's events without those of its second call on (`parallel_tool_calls: false`: at most one call, as
    OpenAI promises, however many the model wrote)."""

    reader: CallStream | JsonCallStream

    @property
    def calls(self) -> int:
        return min(self.reader.calls, 1)

    def push(self, text: str) -> list[StreamEvent]:
        return _first_call(self.reader.push(text))

    def finish(self) -> list[StreamEvent]:
        return _first_call(self.reader.finish())


def _first_call(events: list[StreamEvent]) -> list[StreamEvent]:
    return [event for event in events if isinstance(event, TextDelta) or event.index == 0]


def _json_calls(text: str, names: frozenset[str]) -> tuple[list[ToolCall], bool]:
    """The calls `text` begins with (JSON objects separated by `;`, one `;` after the last allowed), and whether it
    is nothing else."""
    decoder, calls, position = json.JSONDecoder(parse_constant=not_json), [], 0
    while True:
        position = len(text) - len(text[position:].lstrip())
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return calls, False
        arguments = _llama3_arguments(value) if _names_one_of(value, names) else None
        if not isinstance(arguments, dict):
            return calls, False
        calls.append(ToolCall(value["name"], _dump_arguments(arguments)))
        rest = text[position:].lstrip()
        if not rest:
            return calls, True
        if not rest.startswith(";"):
            return calls, False
        if not rest[1:].strip():  # a separator after the last call, as Llama 3 may end its calls
            return calls, True
        position = len(text) - len(rest) + 1


def _llama3_arguments(call: dict[str, Any]) -> Any:
    """A Llama 3 call's arguments: its `parameters`, or its `arguments` where it has that key (which counts where it
    has both, as vLLM's llama3_json parser reads them)."""
    return call["arguments"] if "arguments" in call else call.get("parameters")


def not_json(constant: str) -> Any:
    """Refuses NaN and Infinity (a `parse_constant`), which Python's decoder takes but JSON has not: arguments holding
    one would go out as text no JSON parser reads (the other formats' objects end at such a word: `_ObjectEnd`)."""
    raise ValueError(f"{constant} is not JSON")


@dataclass
class JsonNesting:
    """Follows a JSON text one character at a time: how deep in objects and arrays it is, and whether in a string."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def take(self, char: str) -> bool:
        """Takes in the text's next character; True if it is outside any string (a bracket counted), False if it is
        a string's, its quotes included."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
            return False
        if char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        return True


@dataclass
class _ObjectEnd:
    """Finds where the JSON object a text starts with (after whitespace) ends, reading the text as it grows: each
    character is looked at once however often `find` is asked."""

    _read: int = 0
    _found: int | None = None
    _started: bool = False
    _nesting: JsonNesting = field(default_factory=JsonNesting)

    @property
    def undecided(self) -> int:
        """How much of the text was read before the character that ended the object or showed it is none (all that
        was read, while neither)."""
        return self._read - (self._found is not None)

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
            if not self._nesting.take(char):
                continue
            if char not in _JSON_OUTSIDE_STRINGS:
                return -1
            if char in "}]" and self._nesting.depth == 0:
                return i + 1
        return None


@dataclass
class _ValueEnd:
    """Finds where the JSON value at `start` in an object's text ends (the arguments a call's head opens), reading
    the text as it grows, each character once: after the bracket that closes it, or (a value of no brackets) at the
    `,` or `}` that follows it."""

    start: int
    _read: int = 0
    _found: int | None = None
    _nesting: JsonNesting = field(default_factory=JsonNesting)

    def find(self, text: str) -> int | None:
        """The index in `text` where the value ends; None while it may go on. `text` must extend the text of the
        previous call."""
        if self._found is None:
            self._found = self._scan(text)
        return self._found

    def _scan(self, text: str) -> int | None:
        for i in range(max(self._read, self.start), len(text)):
            char = text[i]
            self._read = i + 1
            if not self._nesting.take(char):
                continue
            if self._nesting.depth < 0 or char == "," and self._nesting.depth == 0:
                return i  # the end of the object that holds the value, or the comma after the value
            if char in "}]" and self._nesting.depth == 0:
                return i + 1
        return None


def _may_begin_head(text: str, names: frozenset[str]) -> bool:
    """Whether `text` (no whole head yet) may still grow into the head of a call by name of one of `names`."""
    so_far = text.lstrip()
    so_far = so_far[:len(so_far) - _partial_tag(so_far, ARGS)]
    name, tag, call_id = so_far.partition(CALL_ID)
    if tag:
        return name in names and (not call_id or (call_id.isascii() and call_id.isalnum()))
    name = name[:len(name) - _partial_tag(name, CALL_ID)]
    return any(known.startswith(name) for known in names)


def _may_begin_object_head(text: str, names: frozenset[str]) -> bool:
    """Whether `text` (no whole head yet) may still grow into the head a grammar writes for a call of one of
    `names`: `{"name": "NAME", "arguments": `, with any whitespace between its parts."""
    for part in ("{", '"name"', ":", None, ",", '"arguments"', ":"):
        text = text.lstrip()
        written = [f'"{name}"' for name in names] if part is None else [part]
        if any(w.startswith(text) for w in written):  # nothing more, or the part still arriving
            return True
        whole = next((w for w in written if text.startswith(w)), None)
        if whole is None:
            return False
        text = text[len(whole):]
    return not text.strip()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be arriving)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
