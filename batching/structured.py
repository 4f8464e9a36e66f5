"""Structured output: a request's grammar compiled by llguidance against the model's own vocabulary, one matcher
per sequence, and the packed bitmask of the tokens each constrained sampler row may take next.

llguidance's tokenizer is built from the served tokenizer's own `tokenizer.json` (the GGUF vocabulary and merges,
or the HF folder's file), never fetched. JSON comes out in one fixed layout, `{"a": 1, "b": [2, 3]}`: with free
whitespace a small model pads with newlines until max_tokens. llguidance is imported here only, when the first
grammar is compiled, so an engine that is never asked for structured output runs without it (the GPU image
lacks it).

A position where the grammar allows exactly one token needs no model step: every sampler would pick that token
(all other logits are -inf), so the engine appends it at once and computes it with the next step's chunk
(`Grammar.forced_token`). Only token-level forcing counts, never a forced byte string that could be tokenized
another way, so the output is the same token for token.

A spec's `preamble` (a reasoning model's thinking) comes before its grammar, which llguidance then holds as a
subgrammar (`@answer`): the request's grammar keeps its own rules and lexer, whatever its kind.

Where a grammar leaves the text free (its mask allows every token free text does: tool_choice auto's calls before
their tag, a reasoning model's thought, a thinking budget's answer), a multi-step call draws the sequence's tokens
without the mask, and the host keeps those drawn where the grammar was still free and took them
(`unmasked_prefixes`). A mask there rules out only special tokens, and EOS where the text may not end (a thought):
greedy, the kept tokens are those a masked draw takes; sampling, they differ only where such a token carried
probability mass.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any

import numpy as np

from sluice.batching.sampling_params import RequestRejected, StructuredOutput
from sluice.model.tokenizer import Tokenizer

CHECKED_SPECS = 1024  # specs whose check's outcome `GrammarCompiler.check` remembers
# llguidance's JSON options; a schema's own "x-guidance" key overrides them.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_WHAT = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class InvalidGrammar(RequestRejected):
    """The request's schema, regex, choice or grammar does not compile, or uses a feature llguidance lacks."""


@dataclass(eq=False)
class Grammar:
    """A sequence's place in its grammar: `matcher` (an llguidance LLMatcher) has consumed the sequence's output
    tokens, but for EOS ids (`eos_token_ids`) the sequence went on past (ignore_eos): llguidance takes an EOS as the
    grammar's end. `executor` (shared by all sequences of a compiler) fills masks in parallel, without the GIL;
    `scratch` ([1, ceil(V / 32)] int32, shared too: used on the engine thread only) holds one row's mask."""

    matcher: Any
    executor: Any
    scratch: np.ndarray
    eos_token_ids: tuple[int, ...]
    free_text: np.ndarray  # [ceil(V / 32)] int32: the mask of free text, EOS aside (shared)
    num_taken: int = 0  # the tokens the matcher has taken (`advance`)
    masked_at: int | None = None  # `num_taken` where the next token must be drawn under the mask (`masked_next`)

    def fork(self) -> Grammar:
        """The same place in the same grammar, advanced independently from now on (another sample)."""
        return replace(self, matcher=self.matcher.deep_copy())

    @property
    def masked_next(self) -> bool:
        """Whether the next token must be drawn under the mask: a multi-step call drew one here without it, which
        fell (`unmasked_prefixes`). Held by the count of tokens taken, as the engine advances the grammar over the
        tokens that stood after the check."""
        return self.masked_at == self.num_taken

    def allows_free_text(self) -> bool:
        """Whether the grammar allows next every token free text does, but maybe EOS: a thought may not end."""
        return not (self.free_text & ~self._next_words()).any()

    def forced_token(self) -> int | None:
        """The next token if the grammar allows exactly one, else None."""
        bits = self._next_tokens()
        return int(np.argmax(bits)) if np.count_nonzero(bits) == 1 else None

    def finished(self) -> bool:
        """Whether the grammar allows nothing but EOS next: it is complete, and nothing may follow."""
        bits = self._next_tokens()
        return np.count_nonzero(bits) == np.count_nonzero(bits[list(self.eos_token_ids)])

    def allows_any(self, tokens: tuple[int, ...]) -> bool:
        """Whether the grammar allows one of `tokens` next."""
        return bool(self._next_tokens()[list(tokens)].any())

    def _next_tokens(self) -> np.ndarray:
        """[32 * ceil(V / 32)] uint8: 1 for each token the grammar allows next."""
        return np.unpackbits(self._next_words().view(np.uint8), bitorder="little")  # bit t of the row: token t

    def _next_words(self) -> np.ndarray:
        """[ceil(V / 32)] int32, the scratch row: the grammar's mask for the next token, packed."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.scratch, 0)
        return self.scratch[0]

    def advance(self, token: int) -> None:
        """Consumes a sampled token. The sampler's mask allowed it, so a refusal is one of llguidance's limits met
        past the first token (`GrammarCompiler._first_token_error`) or a bug; either ends the request."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the output's grammar refused token {token}: "
                               f"{self.matcher.get_error().splitlines()[0]}")
        self.num_taken += 1

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` (speculative drafts) that the grammar allows from here, up to an EOS: a
        draft after one would be checked under the mask of a grammar that has ended (EOS alone), which a sequence
        that goes on past EOS (ignore_eos) does not keep. The row after the last draft samples an EOS anyway."""
        valid = tokens[:self.matcher.validate_tokens(tokens)]
        return valid[:next((j for j, token in enumerate(valid) if token in self.eos_token_ids), len(valid))]


def fill_bitmask(rows: list[tuple[Grammar, int, list[int]]], bitmask: np.ndarray) -> None:
    """Writes the allowed tokens of each (grammar, row, drafts) into `bitmask` [S, words] int32: row `row` for the
    grammar's next token and row `row + j` for the token after its first j drafts (the drafts are consumed to
    get there by a copy of its matcher: llguidance rolls a matcher back wrong over a draft that was the only token
    its mask allowed, written as a token of its own (`<[id]>`, a thinking budget's </think>), and the matcher then
    refuses what its mask allows). One call for the whole batch, in parallel threads, without the GIL."""
    from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

    executor = rows[0][0].executor
    plain = [(grammar.matcher, row) for grammar, row, drafts in rows if not drafts]
    drafted = [(grammar.matcher.deep_copy(), row, drafts) for grammar, row, drafts in rows if drafts]
    if plain:
        fill_next_token_bitmask_par(executor, plain, bitmask)
    if drafted:  # llguidance refuses an empty draft list here
        fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, bitmask)


def unmasked_prefixes(rows: list[tuple[Grammar, list[int]]]) -> list[int]:
    """For each (grammar, tokens a multi-step call drew without its mask): how many of the tokens stand, each drawn
    where the grammar allowed free text (`Grammar.allows_free_text`) and took it; up to an EOS, which the matcher
    does not take where the sequence goes on past it (ignore_eos). A grammar whose tokens fall short of all of them
    has its next token drawn under the mask (`masked_next`): drawn without it, the same token would fall again.
    The masks after each token, one call for the batch as `fill_bitmask` computes a row's drafts'."""
    checked = []  # (grammar, first mask row, tokens its matcher takes)
    num_masks = 0
    for grammar, tokens in rows:
        end = next((j + 1 for j, token in enumerate(tokens) if token in grammar.eos_token_ids), len(tokens))
        taken = tokens[:grammar.matcher.validate_tokens(tokens[:end])]
        checked.append((grammar, num_masks, taken))
        num_masks += len(taken)
    free = np.ones(num_masks, bool)  # [num_masks]: the grammar allowed free text before that token
    if num_masks:  # else every row's first token fell
        words = rows[0][0].free_text
        masks = np.zeros((num_masks, len(words)), np.int32)
        fill_bitmask([(grammar, row, taken[:-1]) for grammar, row, taken in checked if taken], masks)
        free = ~(words & ~masks).any(axis=1)
    standing = []
    for (grammar, row, taken), (_, tokens) in zip(checked, rows):
        count = len(taken) if free[row:row + len(taken)].all() else int(np.argmin(free[row:row + len(taken)]))
        # The engine advances the grammar over those that stand but an EOS (`Engine._advance_grammar`).
        advanced = sum(token not in grammar.eos_token_ids for token in tokens[:count])
        grammar.masked_at = grammar.num_taken + advanced if count < len(tokens) else None
        standing.append(count)
    return standing


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer (about a millisecond for a typical schema)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """vocab_size: the model's (masks have a bit per logit); EOS is allowed where a grammar is complete.

        Raises RequestRejected if llguidance cannot take the tokenizer (one with tokens beyond the model's logits,
        say): then no request of this model can have structured output.
        """
        import llguidance

        self._llguidance = llguidance
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                    eos_token=list(eos_token_ids))
        except ValueError as error:
            raise RequestRejected(f"structured output is not available with this model's tokenizer: {error}") from None
        self.executor = llguidance.LLExecutor()
        self.eos_token_ids = eos_token_ids
        self.scratch = np.zeros((1, -(-vocab_size // 32)), np.int32)
        self.free_text = self._free_text_mask()
        # Over a weak reference: a cache of a bound method would make the compiler a cycle, which only a full
        # collection frees (never, once a later engine's gc.freeze() has frozen it): 30 MB and a thread each.
        self._checked = lru_cache(maxsize=CHECKED_SPECS)(partial(_problem, weakref.proxy(self)))

    def compile(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for `spec`; InvalidGrammar naming the problem if it does not compile."""
        llguidance = self._llguidance
        what = _WHAT[spec.kind]
        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_LAYOUT)
            else:
                grammar = llguidance.grammar_from(spec.kind, spec.source)
        except ValueError as error:  # JSON that does not parse (a schema, a choice list), GBNF that does not convert
            raise InvalidGrammar(f"invalid {what}: {error}") from None
        matcher = self._matcher(grammar, what)
        if spec.preamble is not None:  # the grammar is checked alone first: its first token comes after the preamble
            matcher = self._matcher(_after_preamble(grammar, spec.preamble), what)
        return Grammar(matcher, self.executor, self.scratch, self.eos_token_ids, self.free_text)

    def check(self, spec: StructuredOutput) -> None:
        """Raises InvalidGrammar as `compile` would, keeping no matcher. Outcomes are remembered (the last
        CHECKED_SPECS specs): an agent sends the same tools' schemas with every request."""
        if (problem := self._checked(spec)) is not None:
            raise InvalidGrammar(problem)

    def _matcher(self, grammar: str, what: str) -> Any:
        """A matcher of llguidance's `grammar`; InvalidGrammar if it does not compile or fails its first token."""
        matcher = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"invalid {what}: {matcher.get_error()}")
        if (error := self._first_token_error(matcher)) is not None:
            raise InvalidGrammar(f"{what} too large for structured output: {error}")
        return matcher

    def _free_text_mask(self) -> np.ndarray:
        """[ceil(V / 32)] int32: the tokens free text allows (every token but the special ones), EOS left out: an
        EOS drawn where the grammar refuses it falls in `unmasked_prefixes`, as any token it refuses does."""
        from llguidance.numpy import fill_next_token_bitmask

        matcher = self._llguidance.LLMatcher(self.tokenizer, self._llguidance.grammar_from("regex", "(.|\\n)*"),
                                             log_level=0)
        mask = np.zeros_like(self.scratch)
        fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")  # bit t: token t
        bits[list(self.eos_token_ids)] = 0
        return np.packbits(bits, bitorder="little").view(np.int32)

    def _first_token_error(self, matcher: Any) -> str | None:
        """What llguidance says when a copy of `matcher` takes its first allowed token, if it refuses it: some of
        its parser's limits (lexer states, items per row) show only then, as a refusal of a token its own mask
        allowed, which would end the request mid-reply instead of refusing it now. The copy shares the lexer's
        cache, so this also takes most of the first step's mask off the engine thread (`a{100000}`: 29 ms left of
        136)."""
        from llguidance.numpy import fill_next_token_bitmask

        probe = matcher.deep_copy()
        mask = np.zeros_like(self.scratch)  # not the scratch: this runs off the engine thread
        fill_next_token_bitmask(probe, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if probe.is_error() or len(allowed) and not probe.consume_token(int(allowed[0])):
            return probe.get_error().splitlines()[0]
        return None


def _after_preamble(grammar: str, preamble: str) -> str:
    """llguidance's `grammar` (Lark text, or its JSON list of grammars) as a subgrammar that follows `preamble` (the
    Lark rule `preamble` with the rules it uses): an output matches `preamble`, then `grammar`, whose rules and
    lexer stay its own."""
    answer = json.loads(grammar)["grammars"] if grammar.startswith("{") else [{"lark_grammar": grammar}]
    top = {"lark_grammar": f"start: preamble @answer\n{preamble}"}
    return json.dumps({"grammars": [top, {**answer[0], "name": "answer"}, *answer[1:]]})


def _problem(compiler: GrammarCompiler, spec: StructuredOutput) -> str | None:
    try:
        compiler.compile(spec)
    except InvalidGrammar as error:
        return str(error)
    return None
