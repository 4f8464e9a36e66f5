"""A reasoning model's thinking told apart from its answer (vLLM's `--reasoning-parser`): the text between
`<think>` and `</think>` is the reply's reasoning, sent as `reasoning` (and `reasoning_content`, the older name) in
chat, a `thinking` block in Anthropic's Messages and a `reasoning` item in the Responses API; the rest is its
content, read for tool calls as usual.

Formats: `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3's thinking-only models: the chat template opens
`<think>` in the prompt, so a reply starts inside its reasoning, a `<think>` of its own skipped; without
`</think>` all of it is reasoning, cut short) and `qwen3` (a reply thinks only if it starts with `<think>`, as
Qwen3 does unless `enable_thinking` is false).

Under a structured output the reply thinks freely and its grammar holds the answer after it, as in vLLM: the
grammar comes after `ReasoningFormat.preamble`, llguidance's rule for the reasoning. A thinking budget (vLLM's
`thinking_token_budget`, Anthropic's `budget_tokens`) is held to by the same rule, with any tokens as the answer
where the request has no grammar.

`ReasoningStream` splits a reply as it streams, holding back text that may be the start of a tag; a whole reply
is split at once by the same rule (`ReasoningFormat.split`), which the stream is tested to agree with in any pieces.
`ReplyReader` reads the answer it splits off for calls too. `ReasoningFormat.count_tokens` counts the tokens the
reasoning was generated in, for the usage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from sluice.app.tool_call_streams import StreamEvent, TextDelta
from sluice.app.tool_calls import ToolCalling
from sluice.batching.sampling_params import StructuredOutput
from sluice.model.tokenizer import Tokenizer

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
TEXT = "/(?s:.*)/"  # any text, newlines too
# The blank line models write after </think>, bounded: a small model could otherwise pad it until max_tokens.
BLANK = "BLANK: /[ \\t\\r\\n]{0,4}/"
# A budget's answer without a grammar: any tokens (the thinking before it free too, but for the </think> the budget
# forces).
ANY_ANSWER = StructuredOutput("grammar", "start: <[*]>*", mostly_free=True)


@dataclass(frozen=True)
class Thought:
    """A piece of the reply's reasoning."""

    text: str


@dataclass(frozen=True)
class ReasoningFormat:
    """How a reply's reasoning is marked: `opens_in_prompt`, whether the reply starts inside it (deepseek_r1)."""

    name: str
    opens_in_prompt: bool

    @classmethod
    def named(cls, name: str | None, continuing: bool = False) -> ReasoningFormat | None:
        """The format `name` (None: none); `continuing`: the reply continues the answer of a final assistant message
        (`continue_final_message`, Anthropic's prefill), so it starts inside no reasoning the template opened."""
        return None if name is None else cls(name, opens_in_prompt=name == "deepseek_r1" and not continuing)

    def preamble(self, tokenizer: Tokenizer, budget: int | None = None, eos_token_ids: tuple[int, ...] = ()) -> str:
        """The Lark rule `preamble` (llguidance's, with the rules it uses) for the thinking before a structured
        output's grammar, which as in vLLM holds only the answer: free text up to `</think>`, then the blank before
        the answer; always there with deepseek_r1 (the template opened `<think>`, which the reply may write again),
        only where the reply starts with `<think>` with qwen3. A tag that is one token is written as that token,
        and the thinking holds no `</think>` text then: the reader splits the reply where the grammar does.

        `budget` (vLLM's `thinking_token_budget`): the most tokens the thinking may take, after which `</think>`
        is forced; only where each tag is one token (`binds_budget`). The thought is then counted in tokens, any
        but `</think>` and the `eos_token_ids` (it cannot end the reply, as a thought without a budget cannot):
        llguidance's `max_tokens` would count a text rule's, but its matcher cannot roll back over one, as the
        engine's speculative drafts need. Its text may then spell `</think>` in pieces, as vLLM's budget allows.
        """
        start, end = (_one_token(tokenizer, tag) for tag in (START, END))
        opening = json.dumps(START) if start is None else f"<[{start}]>"
        if end is None:  # lazy: the thought ends at the first </think>
            if budget is not None:
                raise ValueError("a thinking budget needs a vocabulary whose <think> and </think> are tokens")
            thinking, rule = "thought", f"thought[suffix={json.dumps(END)}]: {TEXT}"
        elif budget is None:
            thinking, rule = f"THOUGHT <[{end}]>", f"THOUGHT: {TEXT} & ~({TEXT} {json.dumps(END)} {TEXT})"
        else:
            token = f"<[^{','.join(map(str, sorted({end, *eos_token_ids})))}]>"
            thinking = f"thought <[{end}]>"
            rule = f"thought: {token}{{0,{budget}}}" if budget else 'thought: ""'  # llguidance refuses {0,0}
        opened = f"{opening}? {thinking} BLANK" if self.opens_in_prompt else f"({opening} {thinking} BLANK)?"
        return f"preamble: {opened}\n{rule}\n{BLANK}\n"

    @staticmethod
    def binds_budget(tokenizer: Tokenizer) -> bool:
        """Whether a thinking budget can be held to in this vocabulary: each tag is one token."""
        return all(_one_token(tokenizer, tag) is not None for tag in (START, END))

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None if it has none."""
        span = self._thought_span(text)
        if span is None:
            return None, text
        start, end = span
        return text[start:end] or None, text[end + len(END):].lstrip()  # the blank after </think> left out

    def _thought_span(self, text: str) -> tuple[int, int] | None:
        """Where a whole reply's reasoning is in its text, (start, end): after its `<think>` (written after
        whitespace alone), or from its start where the template opened it, up to its first `</think>` or its end;
        None if it does not think."""
        head = text.lstrip()
        if head.startswith(START):
            start = len(text) - len(head) + len(START)
        elif self.opens_in_prompt:
            start = 0
        else:
            return None
        end = text.find(END, start)
        return start, len(text) if end < 0 else end

    def count_tokens(self, tokenizer: Tokenizer, token_ids: Sequence[int], tags: bool = False) -> int:
        """How many of a reply's generated tokens (`token_ids`, of `tokenizer`'s vocabulary) are its reasoning, for the
        usage's `reasoning_tokens`, as vLLM's reasoning parsers count them (`count_reasoning_tokens`): those between
        the reply's `<think>` (its start, where the template opened it) and its first `</think>`, or its last token
        where max_tokens cut the thought short; the tags' own tokens are not reasoning. With `tags`, those of the
        tags the reply generated are counted too: Anthropic's `thinking_tokens` include "the thinking-block
        delimiter tokens" (as its API documents the field), so that the two counts differ by the tags alone.

        Where each tag is one token (DeepSeek-R1's, Qwen3's), the tags are those tokens, as vLLM and the grammar
        (`preamble`) take them, and the count reads token ids alone. Where a tag is text of several tokens (vLLM's
        parsers refuse such a vocabulary; the reader splits its text all the same), the tags are found in the
        tokens' text as the reader finds them in the reply's, however the reply split them into tokens (SmolLM2
        writes `</think>` as `</`, `think`, `>`, and ` </think>` as ` </`, `think`, `>`), and a token is
        reasoning if any of its text is."""
        opening, closing = _one_token(tokenizer, START), _one_token(tokenizer, END)
        if opening is None or closing is None:
            return self._count_by_text([tokenizer.token_text(token_id) for token_id in token_ids], tags)
        first = next((i for i, token_id in enumerate(token_ids) if not tokenizer.token_text(token_id).isspace()),
                     len(token_ids))
        opened = first < len(token_ids) and token_ids[first] == opening
        if not opened and not self.opens_in_prompt:
            return 0
        start = first + 1 if opened else 0
        closed = closing in token_ids[start:]
        end = token_ids.index(closing, start) if closed else len(token_ids)  # else cut short while thinking
        return end - start + (opened + closed if tags else 0)

    def _count_by_text(self, texts: list[str], tags: bool) -> int:
        """How many of the tokens whose texts are `texts` hold some of the reasoning's text (with `tags`, or of its
        tags' the reply wrote)."""
        text = "".join(texts)
        span = self._thought_span(text)
        if span is None:
            return 0
        start, end = span
        if tags:
            start -= len(START) if text[:start].endswith(START) else 0
            end += len(END) if text.startswith(END, end) else 0
        bounds = pairwise(accumulate(map(len, texts), initial=0))  # each token's (start, end) in the text
        return sum(max(begin, start) < min(stop, end) for begin, stop in bounds)


def _one_token(tokenizer: Tokenizer, tag: str) -> int | None:
    """The tag's token, if the vocabulary holds it as one (special, as DeepSeek-R1's, or not, as Qwen3's)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of `<think>` and `</think>` where each is one special token in this vocabulary: their text is in the
    reply only where the detokenizer keeps it (`SamplingParams.kept_special_ids`)."""
    return frozenset(i for i in map(tokenizer.special_token_id, (START, END)) if i is not None)


class ReasoningStream:
    """Splits a reply's text, pushed piece by piece, into `Thought`s and the answer's `TextDelta`s. The answer's
    leading whitespace after `</think>` (its blank line) is left out; a reply that does not think is as written."""

    def __init__(self, format: ReasoningFormat) -> None:
        self._opens_in_prompt = format.opens_in_prompt
        self._state = "opening"  # then "thinking" (or straight to "answering"), then "answering"
        self._held = ""  # text that may start a tag (or, opening, the reply's leading whitespace)
        self._after_end = False  # whether the answer after </think> is yet to begin (whitespace is left out)

    @property
    def answering(self) -> bool:
        """Whether all text pushed from now on is the answer's, as written."""
        return self._state == "answering" and not self._after_end

    def push(self, text: str) -> list[Thought | TextDelta]:
        self._held += text
        pieces: list[Thought | TextDelta] = []
        if self._state == "opening":
            head = self._held.lstrip()
            if START.startswith(head):  # whitespace alone, or the start of <think>: wait for more
                return pieces
            self._open(head)
        if self._state == "thinking":
            end = self._held.find(END)
            if end < 0:  # all of it is reasoning, but an end that may start </think>
                keep = len(self._held) - _partial_tag_length(self._held, END)
                pieces += self._thought(self._held[:keep])
                self._held = self._held[keep:]
                return pieces
            pieces += self._thought(self._held[:end])
            self._held = self._held[end + len(END):]
            self._state, self._after_end = "answering", True
        held, self._held = self._held, ""
        return pieces + self._answer(held)

    def finish(self) -> list[Thought | TextDelta]:
        """What is still held, now that the reply has ended."""
        if self._state == "opening":
            self._open(self._held.lstrip())  # not a whole <think>
        held, self._held = self._held, ""
        return self._thought(held) if self._state == "thinking" else self._answer(held)

    def _open(self, head: str) -> None:
        """Decides from the reply's first text (`head`, without leading whitespace) whether it thinks."""
        if head.startswith(START):
            self._held, self._state = head[len(START):], "thinking"
        else:
            self._state = "thinking" if self._opens_in_prompt else "answering"

    @staticmethod
    def _thought(text: str) -> list[Thought | TextDelta]:
        return [Thought(text)] if text else []

    def _answer(self, text: str) -> list[Thought | TextDelta]:
        if self._after_end:
            text = text.lstrip()
            self._after_end = not text
        return [TextDelta(text)] if text else []


class ReplyReader:
    """Reads a reply's text, pushed piece by piece, for its reasoning (with a `reasoning` format) and its answer for
    calls (with `calling`): `Thought`s, then the answer's `TextDelta`s, `CallStart`s and `ArgumentsDelta`s."""

    def __init__(self, reasoning: ReasoningFormat | None, calling: ToolCalling | None) -> None:
        self._thoughts = reasoning.stream() if reasoning is not None else None
        self._calls = calling.stream() if calling is not None else None
        self.answered = 0  # UTF-8 bytes of answer so far (before calls are read out of it)

    @property
    def answering(self) -> bool:
        """Whether all text pushed from now on is the answer's, as written (no reasoning, tag or blank)."""
        return self._thoughts is None or self._thoughts.answering

    @property
    def calls(self) -> int:
        """How many calls the answer has started so far."""
        return self._calls.calls if self._calls is not None else 0

    def push(self, text: str) -> list[Thought | StreamEvent]:
        if self._thoughts is None:
            return self._answer([TextDelta(text)] if text else [])
        return self._answer(self._thoughts.push(text))

    def finish(self) -> list[Thought | StreamEvent]:
        """What is still held, now that the reply has ended."""
        pieces = self._answer(self._thoughts.finish()) if self._thoughts is not None else []
        return pieces + (self._calls.finish() if self._calls is not None else [])

    def _answer(self, pieces: list[Thought | TextDelta]) -> list[Thought | StreamEvent]:
        """The pieces with the answer's read for calls."""
        self.answered += sum(len(piece.text.encode()) for piece in pieces if isinstance(piece, TextDelta))
        if self._calls is None:
            return list(pieces)
        read: list[Thought | StreamEvent] = []
        for piece in pieces:
            read += [piece] if isinstance(piece, Thought) else self._calls.push(piece.text)
        return read


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
