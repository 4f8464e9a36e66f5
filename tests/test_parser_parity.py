"""Differential tests of the readers that turn a reply's text into API structure (`app/tool_call_streams.py`,
`app/reasoning.py`): a reply streamed in any pieces reads as its whole text does, with the same reasoning, content,
calls (names, arguments, order) and finish reason, through the readers and through each API's builder (chat
completions, Anthropic's Messages, the Responses API), whose clients join the streamed deltas.

The readers get each increment's text whole characters at a time (the detokenizer holds a character's first bytes
back until its last arrives), so pieces split between code points, never inside one: an emoji's ZWJ sequence, a
flag, or a letter and its combining accent may be split, and a JSON string may escape an emoji as a surrogate pair.

Replies, for each format and reasoning parser: random ones (seeded; `SLUICE_PARITY_SEEDS` of them, 100 by default),
written as the call grammar writes them (a forced call), freely (well formed or not), or freely to a reader that
expects forced calls (text off the grammar), and cut anywhere as max_tokens would; and hand-written adversarial
ones, split at every position.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import pytest

from sluice.app.anthropic_responses import MessageBuilder
from sluice.app.reasoning import ReasoningFormat, ReplyReader, Thought
from sluice.app.responses import ChatBuilder
from sluice.app.responses_api_builder import ResponsesBuilder
from sluice.app.responses_api_schemas import ResponseObject, TextConfig
from sluice.app.schemas import ChatCompletionRequest
from sluice.app.tool_call_streams import ArgumentsDelta, CallStart, TextDelta
from sluice.app.tool_calls import ToolCalling
from sluice.batching.outputs import Increment, Usage

SEEDS = int(os.environ.get("SLUICE_PARITY_SEEDS", "100"))
# Names of which one begins another, as a call by name is read before its name has all arrived.
NAMES = frozenset({"a", "add", "add_2", "get-weather"})
FORMATS = ("hermes", "mistral", "mistral_by_name", "llama3_json", "granite")
PARSER = {"hermes": "hermes", "mistral": "mistral", "mistral_by_name": "mistral", "llama3_json": "llama3_json",
          "granite": "granite"}
# The formats whose calls are a JSON list after a marker: the marker as the call grammar writes it, the markers a
# model may write, and whether a list may be empty.
LIST_MARKERS = {"mistral": ("[TOOL_CALLS] ", ["[TOOL_CALLS]"], False),
                "granite": ("<|tool_call|>", ["<|tool_call|>", "<tool_call>", "<|tool_call|> <tool_call>"], True)}
REASONING = {"none": None, "deepseek_r1": ReasoningFormat.named("deepseek_r1"),
             "qwen3": ReasoningFormat.named("qwen3"),
             "deepseek_r1 continuing": ReasoningFormat.named("deepseek_r1", continuing=True)}
# "forced": written as the grammar forces calls; "free": anything, read for calls; "off grammar": anything, read as
# forced calls are (a thought under a thinking budget may spell </think> in pieces and go on as the answer).
MODES = ("forced", "free", "off grammar")

TEXT = ["Sure.", "Let me check", "ok", " ", "  ", "\n", "\n\n", "\t", "é", "e\u0301", "中文", "🙂", "👩\u200d💻", "🇫🇷",
        "\u2028", "\x00"]
MARKUP = ["<", "[", "{", "}", "]", '"', "\\", ";", ",", ":", "<tool_call>", "</tool_call>", "<tool", "</tool_call",
          "[TOOL_CALLS]", "[TOOL", "[ARGS]", "[CALL_ID]", "<|tool_call|>", "<|tool", "<think>", "</think>", "<th",
          "</thi", '"name"', "add"]


# --- replies ---------------------------------------------------------------------------------------------------


def prose(rng: random.Random, most: int = 5) -> str:
    """Text around calls: words, whitespace, unicode, and markup of every format."""
    return "".join(rng.choice(TEXT + MARKUP) for _ in range(rng.randint(0, most)))


def value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -1, 2.5, 1e10, True, False, None])
    if kind < 4:
        return prose(rng, 4)  # quotes, backslashes, braces and tags inside strings
    if kind < 6:
        return {prose(rng, 2): value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def arguments(rng: random.Random) -> dict:
    return {rng.choice(["city", "a", "x y", "ü"]) + prose(rng, 1): value(rng) for _ in range(rng.randint(0, 3))}


def layout(rng: random.Random, data: object) -> str:
    """`data` as JSON in one of the layouts a model writes freely."""
    return json.dumps(data, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, None, None, 2]),
                      separators=rng.choice([(", ", ": "), (",", ":"), (" , ", " : ")]))


def grammar_json(rng: random.Random, data: object) -> str:
    """`data` as the call grammar writes JSON (`tool_calls._LAYOUT`), its strings escaped or not."""
    return json.dumps(data, ensure_ascii=rng.random() < 0.3)


def any_name(rng: random.Random) -> str:
    return rng.choice(sorted(NAMES) + ["launch", "ad", ""])


def whitespace(rng: random.Random) -> str:
    return rng.choice(["", "", " ", "\n", "\n\n", " \t"])


def forced_calls(rng: random.Random, format: str, count: int) -> str:
    """`count` calls as the call grammar of `format` writes them (`tool_calls.call_grammar`)."""
    calls = [(rng.choice(sorted(NAMES)), arguments(rng)) for _ in range(count)]
    if format == "hermes":
        return "\n".join(f"<tool_call>\n{grammar_json(rng, {'name': n, 'arguments': a})}\n</tool_call>"
                         for n, a in calls)
    if format in LIST_MARKERS:
        objects = ", ".join(grammar_json(rng, {"name": n, "arguments": a}) for n, a in calls)
        return f"{LIST_MARKERS[format][0]}[{objects}]"
    if format == "mistral_by_name":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{grammar_json(rng, a)}" for n, a in calls)
    return "; ".join(grammar_json(rng, {"name": n, "parameters": a}) for n, a in calls)


def free_object(rng: random.Random, key: str = "arguments") -> str:
    """A call's JSON object as a model may write it unforced: well formed, or not a call in one of many ways."""
    name, args = json.dumps(any_name(rng)), layout(rng, arguments(rng))
    return rng.choice([
        f'{{"name": {name}, "{key}": {args}}}',
        f'{{"name": {name}, "{key}": {args}}}',
        f'{{"{key}": {args}, "name": {name}}}',  # read, then written again in the usual layout
        f'{{"name": {name}, "{key}": {args}',  # never closes
        f'{{"name": {name}, "{key}": {layout(rng, value(rng))}}}',  # arguments that may be no object
        f'{{"name": {name}, "{key}": {args}, "id": 7}}',
        f'{{"name": {name}, "{key}": {args}, "{key}": {{}}}}',  # written twice
        f'{{"name": {name},{whitespace(rng)}"{key}":{whitespace(rng)}{args}{whitespace(rng)}}}',
    ])


def free_call(rng: random.Random, format: str) -> str:
    if format == "hermes":
        close = rng.choice(["</tool_call>"] * 6 + ["", "</tool_call", "</tool_calls>", "<tool_call>"])
        return f"<tool_call>{whitespace(rng)}{free_object(rng)}{whitespace(rng)}{close}"
    if format in LIST_MARKERS:
        _, markers, may_be_empty = LIST_MARKERS[format]
        separator = rng.choice([", ", ",", " ,\n", "; "])
        objects = separator.join(free_object(rng) for _ in range(rng.randint(0 if may_be_empty else 1, 3)))
        marker = rng.choice(markers)
        return f"{marker}{whitespace(rng)}[{objects}{rng.choice([']', ']', ']', '', '}'])}"
    if format == "mistral_by_name":
        call_id = rng.choice(["", "", "[CALL_ID]abc123XYZ", "[CALL_ID]a-b", "[CALL_ID]"])
        args = rng.choice([layout(rng, arguments(rng)), layout(rng, arguments(rng)), '"a=1"', "{", "[]"])
        return f"[TOOL_CALLS]{whitespace(rng)}{any_name(rng)}{call_id}[ARGS]{whitespace(rng)}{args}"
    key = "parameters" if rng.random() < 0.8 else "arguments"
    return rng.choice([";", "; ", " ;\n"]).join(free_object(rng, key) for _ in range(rng.randint(1, 3)))


THOUGHTS = ["", "<think>{}</think>", "<think>\n{}\n</think>\n\n", "{}</think>", "{}</think>\n\n", "<think>{}",
            "<think></think>", "</think>", " \n<think>{}</think> ", "<think>{}<think>{}</think>{}</think>", "<thi"]


def random_reply(rng: random.Random, format: str, thinks: bool, mode: str) -> str:
    """A reply in `format`: a thought first where the reply is read for reasoning (`thinks`), then its answer; a
    quarter of them cut anywhere, as max_tokens or a stop string would."""
    text = rng.choice(THOUGHTS).format(prose(rng), prose(rng), prose(rng)) if thinks else ""
    if mode == "forced":
        text += forced_calls(rng, format, rng.randint(1, 3))
    elif format == "llama3_json" and rng.random() < 0.6:  # its calls are the whole reply or nothing
        text += whitespace(rng) + free_call(rng, format) + rng.choice(["", " ", "\n", ";", " and more"])
    else:
        text += "".join(free_call(rng, format) if rng.random() < 0.5 else prose(rng)
                        for _ in range(rng.randint(0, 4)))
    return text[:rng.randint(0, len(text))] if rng.random() < 0.25 else text


def random_pieces(rng: random.Random, text: str) -> list[str]:
    """`text` as a stream's increments: whole, a character each, a few cuts, or short runs; some empty (a token
    whose text is held back, for a stop string or the rest of a character)."""
    kind = rng.randrange(5)
    if kind == 0:
        cuts = []
    elif kind == 1:
        cuts = list(range(1, len(text)))
    elif kind == 2:
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
    else:  # runs of 1 to 8 characters
        cuts = [rng.randint(1, 8)]
        while cuts[-1] < len(text):
            cuts.append(cuts[-1] + rng.randint(1, 8))
        cuts.pop()
    bounds = [0, *cuts, len(text)]
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    for _ in range(rng.choice([0, 0, 1, 3])):
        pieces.insert(rng.randint(0, len(pieces)), "")
    return pieces


def split_anywhere(text: str) -> list[list[str]]:
    """`text` in two pieces at each position, in three at each pair of positions a few apart, and a character a
    piece."""
    pieces = [[text[:i], text[i:]] for i in range(1, len(text))]
    pieces += [[text[:i], text[i:i + gap], text[i + gap:]] for gap in (1, 2, 7) for i in range(1, len(text) - gap)]
    return pieces + [list(text)]


# --- reading ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What a reply reads as: its reasoning, its content, its calls ((name, arguments) each, in order), and whether
    it called (the finish reason is then "tool_calls")."""

    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, str], ...]
    called: bool


@dataclass(frozen=True)
class Case:
    format: str
    reasoning: ReasoningFormat | None
    mode: str
    parallel: bool = True
    calls: bool = True  # whether the request has tools

    @property
    def calling(self) -> ToolCalling | None:
        return ToolCalling(NAMES, PARSER[self.format], self.mode != "free", self.parallel) if self.calls else None


def read_whole(case: Case, text: str) -> Reading:
    """The reply as the chat route reads a whole one (`ChatBuilder._choice`): reasoning split off, then calls."""
    reasoning, answer = (None, text) if case.reasoning is None else case.reasoning.split(text)
    if case.calling is None:
        return Reading(reasoning, answer or None, (), False)
    content, calls = case.calling.parse(answer)
    return Reading(reasoning, content, tuple((call.name, call.arguments) for call in calls), bool(calls))


def read_streamed(case: Case, pieces: list[str]) -> Reading:
    """The reply as a stream reads it (`ReplyReader`), its events in an order each API's stream can show: thoughts
    before the answer, calls numbered in order, and each call's arguments right after its start (Anthropic's stream
    adds them to the block opened last)."""
    reader = ReplyReader(case.reasoning, case.calling)
    events = [event for piece in pieces for event in reader.push(piece)] + reader.finish()
    calls: list[list[str]] = []
    for before, event in zip([None, *events], events):
        if isinstance(event, Thought):
            assert before is None or isinstance(before, Thought), events
        elif isinstance(event, CallStart):
            assert event.index == len(calls), events
            calls.append([event.name, ""])
        elif isinstance(event, ArgumentsDelta):
            assert isinstance(before, CallStart | ArgumentsDelta) and event.index == len(calls) - 1, events
            calls[-1][1] += event.text
    reasoning = "".join(event.text for event in events if isinstance(event, Thought))
    content = "".join(event.text for event in events if isinstance(event, TextDelta))
    return Reading(reasoning or None, content or None, tuple(map(tuple, calls)), reader.calls > 0)


def random_case(rng: random.Random, format: str, reasoning: str) -> Case:
    return Case(format, REASONING[reasoning], rng.choice(MODES), parallel=rng.random() < 0.8,
                calls=reasoning == "none" or rng.random() < 0.9)


@pytest.mark.parametrize("reasoning", REASONING)
@pytest.mark.parametrize("format", FORMATS)
def test_a_random_reply_reads_the_same_streamed_in_any_pieces_as_whole(format: str, reasoning: str) -> None:
    seen = {"calls": 0, "content": 0, "reasoning": 0}
    for seed in range(SEEDS):
        rng = random.Random(f"{format} {reasoning} {seed}")
        case = random_case(rng, format, reasoning)
        text = random_reply(rng, format, case.reasoning is not None, case.mode)
        whole = read_whole(case, text)
        for pieces in [list(text), *(random_pieces(rng, text) for _ in range(3))]:
            assert read_streamed(case, pieces) == whole, f"{case}: {text!r} in {pieces!r}"
        seen = {"calls": seen["calls"] + bool(whole.calls), "content": seen["content"] + bool(whole.content),
                "reasoning": seen["reasoning"] + bool(whole.reasoning)}
    # The replies are worth reading: some make calls, have content, and (with a parser) reason.
    assert seen["calls"] > SEEDS / 20 and seen["content"] > SEEDS / 20
    assert (seen["reasoning"] > SEEDS / 20) == (reasoning != "none")


# Hand-written replies: (format, reasoning, mode, reply) by what each tries.
ADVERSARIAL = {
    "text around a call": (
        "hermes", "none", "free",
        'Let me look. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\nDone.'),
    "tags, quotes and unicode in strings, text between calls": (
        "hermes", "none", "free",
        '<tool_call>{"name": "add", "arguments": {"s": "</tool_call>{\\"}\\\\"}}</tool_call>'
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>between<tool_call>'
        '{"name": "get-weather", "arguments": {"city": "🇫🇷 👩\u200d💻 e\u0301"}}</tool_call>'),
    "a stray close, a tag twice, nested brackets, a tag cut short": (
        "hermes", "none", "free", '</tool_call> stray, <tool_call><tool_call>{"name": "add", "arguments": '
        '{"a": {"b": [{"c": "}]"}]}}}</tool_call> <tool_ca'),
    "a call cut inside its JSON": ("hermes", "none", "free", '<tool_call>{"name": "add", "arguments": {"a": 1}\n'),
    "a call the reply ends without closing": (
        "hermes", "none", "free", 'Sure <tool_call>{"name": "add", "arguments": {"a": "\\ud83d\\ude42"}}\n'),
    "no tool, no object, arguments before the name": (
        "hermes", "none", "free", '<tool_call>{"name": "launch", "arguments": {}}</tool_call> <tool_call>'
        '{"name": "add", "arguments": "a=1"}</tool_call> <tool_call>{"arguments": {"a": 1}, "name": "add"}'
        "</tool_call>"),
    "forced calls with a close tag in a string": (
        "hermes", "none", "forced", '<tool_call>\n{"name": "add", "arguments": {"a": "}\\"</tool_call>", "b": '
        '[1, {"c": {}}]}}\n</tool_call>\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'),
    "forced calls off the grammar": (
        "hermes", "none", "off grammar", 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1} x}\n</tool_call> '
        '<tool_call>{"name": "add", "arguments": {"a": 1}, "id": 2}</tool_call>'),
    "a mistral list, a broken one, a marker cut short": (
        "mistral", "none", "free", 'Let me check. [TOOL_CALLS] [{"name": "add", "arguments": {"a": "]}"}}, '
        '{"name": "a", "arguments": {"b": "[TOOL_CALLS] ["}}] and [TOOL_CALLS] [{broken}] [TOOL_CA'),
    "mistral call ids after the arguments, off the grammar": (
        "mistral", "none", "off grammar", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": {"b": "}"}}, "id": '
        '"abcdefghi"}, {"name": "a", "arguments": {} , "id": "bcdefghij"}] [TOOL_CALLS] [{"name": "a", "arguments": '
        '{"c": 1}\n, "id": "cdefg'),
    "a mistral list of the wrong separator": (
        "mistral", "none", "free", '[TOOL_CALLS] [{"name": "add", "arguments": {}}; {"name": "a", "arguments": {}}]'),
    "forced mistral calls": (
        "mistral", "none", "forced", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": [1, {"b": "]"}]}}, '
        '{"name": "get-weather", "arguments": {"city": "Köln"}}]'),
    "mistral calls by name, names that begin others, ids": (
        "mistral_by_name", "none", "free",
        'Sure. [TOOL_CALLS]add[ARGS]{"x": "[ARGS]}"}[TOOL_CALLS]a[CALL_ID]abc123XYZ'
        '[ARGS]{}[TOOL_CALLS]ad[ARGS]{} [TOOL_CALLS]add_2[CALL_ID]a-b[ARGS]{} [TOOL'),
    "a mistral name the reply ends in": ("mistral_by_name", "none", "free", "[TOOL_CALLS]a"),
    "forced mistral calls by name": (
        "mistral_by_name", "none", "forced", '[TOOL_CALLS]add_2[ARGS]{"a": "[TOOL_CALLS]"}[TOOL_CALLS]a[ARGS]{}'),
    "granite lists after either marker, a broken one, a marker cut short": (
        "granite", "none", "free", 'Let me check. <|tool_call|>[{"name": "add", "arguments": {"a": "]}"}}, '
        '{"name": "a", "arguments": {"b": "<tool_call>["}}] and <tool_call> [{"name": "a", "arguments": {}}] '
        '<|tool_call|>[{broken}] <tool_call>{"name": "a", "arguments": {}}</tool_call> <|tool_ca'),
    "empty granite lists, the 3.0 marker then the 3.1 one, twice": (
        "granite", "none", "free", 'Nothing. <|tool_call|>[] <tool_call> [ ]<|tool_call|>\n<tool_call>[{"name": '
        '"add", "arguments": {}}] <|tool_call|><tool_call><|tool_call|>[] <|tool_call|>[ } <|tool_call|><tool'),
    "forced granite calls": (
        "granite", "none", "forced", '<|tool_call|>[{"name": "add", "arguments": {"a": [1, {"b": "]"}]}}, '
        '{"name": "get-weather", "arguments": {"city": "Köln"}}]'),
    "llama 3 calls with a separator in a string": (
        "llama3_json", "none", "free",
        ' {"name": "add", "parameters": {"a": ";"}}; {"name": "a", "parameters": {}}\n'),
    "llama 3 calls ending in a separator, one that writes both keys": (
        "llama3_json", "none", "free",
        '{"name": "add", "parameters": {"a": 1}}; {"name": "a", "arguments": {"b": 2}, "parameters": "x"} ;\n'),
    "a llama 3 call then prose": (
        "llama3_json", "none", "free", '{"name": "add", "parameters": {"a": 1}} and then some prose'),
    "llama 3 prose that begins as JSON": ("llama3_json", "none", "free", "  { is how JSON begins"),
    "a call in the thought, a close tag in the answer's": (
        "hermes", "deepseek_r1", "free", 'Which tool? <tool_call>{"name": "add", "arguments": {}}</tool_call></think>'
        '\n\n<tool_call>{"name": "add", "arguments": {"t": "</think>"}}</tool_call>'),
    "thoughts opened twice": ("hermes", "deepseek_r1", "free", "<think>a<think>b</think>c</think>d"),
    "a thought that never closes": ("hermes", "deepseek_r1", "free", "thinking that never closes </thi"),
    "an empty thought": ("hermes", "deepseek_r1", "free", "<think></think>  \n"),
    "an opening tag cut short": ("hermes", "qwen3", "free", "  <thi"),
    "a stray close in an answer": ("hermes", "qwen3", "free", "answer </think> with a stray close"),
    "a thought then forced calls": (
        "hermes", "qwen3", "forced", '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        "</tool_call>"),
    "a thought of emoji then a mistral call": (
        "mistral", "qwen3", "free", '<think>é🙂</think>[TOOL_CALLS] [{"name": "add", "arguments": {}}]'),
    "a llama 3 call after a thought": (
        "llama3_json", "deepseek_r1", "free", 'hm</think>\n{"name": "add", "parameters": {"a": 1}}'),
}


@pytest.mark.parametrize(("format", "reasoning", "mode", "text"), ADVERSARIAL.values(), ids=ADVERSARIAL)
def test_an_adversarial_reply_reads_the_same_split_anywhere_as_whole(format: str, reasoning: str, mode: str,
                                                                     text: str) -> None:
    for parallel in (True, False):
        case = Case(format, REASONING[reasoning], mode, parallel)
        whole = read_whole(case, text)
        for pieces in split_anywhere(text):
            assert read_streamed(case, pieces) == whole, f"{case}: {pieces!r}"


@pytest.mark.parametrize("format", FORMATS)
def test_a_forced_reply_cut_anywhere_reads_the_same_streamed_as_whole(format: str) -> None:
    """A forced reply's calls stream their arguments as they arrive: whatever max_tokens leaves of it reads alike."""
    rng = random.Random(format)
    answer = forced_calls(rng, format, 2)
    for reasoning, text in (("none", answer), ("qwen3", "<think>é</think>\n\n" + answer)):
        case = Case(format, REASONING[reasoning], "forced")
        for cut in (text[:end] for end in range(len(text) + 1)):
            whole = read_whole(case, cut)
            for pieces in (list(cut), random_pieces(rng, cut)):
                assert read_streamed(case, pieces) == whole, f"{case}: {pieces!r}"


# --- each API's whole reply and the one its stream assembles ----------------------------------------------------


class _Replay:
    """A generation of one choice whose increments' texts are `pieces` (at least one, the last with the finish)."""

    def __init__(self, pieces: list[str], finish: str) -> None:
        self._pieces = pieces or [""]
        self._finish = finish
        self.usage = Usage(prompt_tokens=1, completion_tokens=sum(map(len, self._pieces)))

    async def increments(self) -> AsyncGenerator[Increment, None]:
        for i, piece in enumerate(self._pieces):
            yield Increment(0, piece, tuple(map(ord, piece)),
                            finish_reason=self._finish if i == len(self._pieces) - 1 else None)


class _Characters:
    """A tokenizer for the usage's reasoning tokens: a character a token (its code point)."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return list(map(ord, text))

    @staticmethod
    def token_text(token_id: int) -> str:
        return chr(token_id)


def _collect(builder: object, pieces: list[str], finish: str) -> object:
    return asyncio.run(builder.collect(_Replay(pieces, finish)))


def _events(builder: object, pieces: list[str], finish: str) -> list[dict]:
    """A builder's stream, each event's data as JSON (`[DONE]` left out)."""
    async def stream() -> list[bytes]:
        return [event async for event in builder.events(_Replay(pieces, finish))]

    return [json.loads(event.split(b"data: ", 1)[1]) for event in asyncio.run(stream()) if b"[DONE]" not in event]


def chat_builder(case: Case, stream: bool) -> ChatBuilder:
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": stream,
                                                 **usage})
    return ChatBuilder("chatcmpl-1", "m", _Characters(), body, [1], case.calling, case.reasoning)


def chat_whole(case: Case, text: str, finish: str) -> tuple:
    response = _collect(chat_builder(case, False), [text], finish)
    [choice] = response.choices
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    details = response.usage.completion_tokens_details
    return (choice.message.reasoning, choice.message.content or None, calls, choice.finish_reason,
            details and details.model_dump(exclude_none=True))


def chat_streamed(case: Case, pieces: list[str], finish: str) -> tuple:
    """The message an OpenAI client assembles from the chunks: texts joined, each call's arguments joined by index."""
    reasoning, content, calls, finish_reason, details = "", "", {}, None, None
    for chunk in _events(chat_builder(case, True), pieces, finish):
        if chunk["usage"] is not None:
            details = chunk["usage"].get("completion_tokens_details")
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], (call["function"].get("name"), ""))
                calls[call["index"]] = (name, arguments + (call["function"].get("arguments") or ""))
            finish_reason = choice["finish_reason"] or finish_reason
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish_reason, details


def anthropic_whole(case: Case, text: str, finish: str) -> tuple:
    message = _collect(MessageBuilder("msg_1", "m", 1, case.calling, case.reasoning), [text], finish)
    blocks = [{k: v for k, v in block.model_dump(exclude_none=True).items() if k != "id"}
              for block in message.content]
    return blocks, message.stop_reason


def anthropic_streamed(case: Case, pieces: list[str], finish: str) -> tuple:
    """The message an Anthropic client assembles: blocks by index, a tool_use block's input its partial JSON joined
    (`{}` where that is no JSON, as the whole message has it for a call max_tokens cut)."""
    blocks, partial, stop_reason = {}, {}, None
    for event in _events(MessageBuilder("msg_1", "m", 1, case.calling, case.reasoning), pieces, finish):
        assert event["type"] != "error", event
        if event["type"] == "content_block_start":
            blocks[event["index"]] = {k: v for k, v in event["content_block"].items() if k != "id" and v is not None}
            partial[event["index"]] = ""
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": None,
                     "signature_delta": "signature"}[delta["type"]]
            if field is None:
                partial[event["index"]] += delta["partial_json"]
            else:
                block[field] = (block[field] if field != "signature" else "") + delta[field]
        elif event["type"] == "message_delta":
            stop_reason = event["delta"]["stop_reason"]
    for index, text in partial.items():
        if blocks[index]["type"] == "tool_use":
            try:
                blocks[index]["input"] = json.loads(text)
            except ValueError:
                blocks[index]["input"] = {}
    return [blocks[i] for i in sorted(blocks)], stop_reason


def _items(output: list[dict]) -> list[tuple]:
    return [(item["type"], item["status"], item.get("name"), item.get("arguments"),
             item["content"][0]["text"] if item.get("content") else None) for item in output]


def responses_builder(case: Case) -> ResponsesBuilder:
    response = ResponseObject(id="resp_1", created_at=0, status="in_progress", instructions=None, model="m",
                              output=[], max_output_tokens=None, parallel_tool_calls=case.parallel,
                              previous_response_id=None, temperature=1.0, top_p=1.0, tool_choice="auto", tools=[],
                              text=TextConfig(), store=False, metadata={})
    return ResponsesBuilder(response, case.calling, lambda _: None, reasoning=case.reasoning, tokenizer=_Characters())


def responses_whole(case: Case, text: str, finish: str) -> tuple:
    response = _collect(responses_builder(case), [text], finish).model_dump()
    return _items(response["output"]), response["status"], response["usage"]["output_tokens_details"]


def responses_streamed(case: Case, pieces: list[str], finish: str) -> tuple:
    """The output a Responses client assembles from the deltas, which must be the last event's response's."""
    items, last = {}, None
    for event in _events(responses_builder(case), pieces, finish):
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            items[index] = event["item"]
        elif kind == "response.content_part.added":
            items[index]["content"] = [event["part"]]
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[index]["content"][0]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            items[index]["status"] = event["item"]["status"]
        elif kind in ("response.completed", "response.incomplete"):
            last = event["response"]
    assembled = _items([items[i] for i in sorted(items)])
    assert assembled == _items(last["output"])
    return assembled, last["status"], last["usage"]["output_tokens_details"]


APIS: dict[str, tuple[Callable, Callable]] = {"chat": (chat_whole, chat_streamed),
                                              "anthropic": (anthropic_whole, anthropic_streamed),
                                              "responses": (responses_whole, responses_streamed)}


@pytest.mark.parametrize("api", APIS)
def test_an_apis_stream_assembles_to_its_whole_reply(api: str) -> None:
    whole_of, streamed_of = APIS[api]
    for seed in range(SEEDS):
        rng = random.Random(f"{api} {seed}")
        format, reasoning = rng.choice(FORMATS), rng.choice(list(REASONING))
        case = random_case(rng, format, reasoning)
        text = random_reply(rng, format, case.reasoning is not None, case.mode)
        finish = rng.choice(["stop", "length"])
        whole = whole_of(case, text, finish)
        pieces = random_pieces(rng, text)
        assert streamed_of(case, pieces, finish) == whole, f"{case}, {finish}: {text!r} in {pieces!r}"


@pytest.mark.parametrize("cut", ['[1, 2]', '-1', '"a"'])
def test_a_call_cut_where_its_arguments_read_as_json_but_no_object_has_an_empty_input(cut):
    """A forced call's arguments stream as written, so max_tokens may cut them where they parse as another JSON
    value; the whole message's tool_use block has an object for its input all the same, as for any other cut (its
    stream has sent the text as written: what a client joins from it cannot be taken back)."""
    blocks, stop_reason = anthropic_whole(Case("hermes", None, "forced"),
                                          '<tool_call>{"name": "add", "arguments": ' + cut, "length")
    assert [(block["type"], block["name"], block["input"]) for block in blocks] == [("tool_use", "add", {})]
    assert stop_reason == "max_tokens"
