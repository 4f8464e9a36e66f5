"""Deciding, token by token, whether a sequence stops and which text it may emit so far.

Stop strings are matched on the detokenized text, so a stop string split across tokens is still found. Text
that could be the start of a stop string is held back until the next tokens settle it, so a stop string is
never emitted, not even in part.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from sluice.batching.outputs import FinishReason
from sluice.batching.sampling_params import SamplingParams


class Detokenizer(Protocol):
    def push(self, new_ids: list[int]) -> str: ...

    def flush(self) -> str:
        """The text held back for a character not yet complete, its bytes as U+FFFD: the sequence ends here."""
        ...


class StopDecision(NamedTuple):
    """`text`: what may be emitted now; `finish_reason`: set when the sequence is done."""

    text: str
    finish_reason: FinishReason | None = None


def stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a sequence: its stop ids, and the model's EOS ids unless it ignores them."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))


class StopChecker:
    """Stop state of one sequence; feed it each sampled token in order.

    The check is split so the engine can stop a sequence on its token id at once and do the text work (and
    stop strings) later, while the device runs the next step.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...], detokenizer: Detokenizer):
        self.params = params
        self.stop_ids = stop_token_ids(params, eos_token_ids)
        self.stop_id_list = tuple(sorted(self.stop_ids))  # as the sampler packs them
        self.detokenizer = detokenizer
        self.text = ""  # the output text so far, kept by `emit`: only with stop strings to search it for
        # Per stop string, the longest tail of the text that is a proper prefix of it.
        self._stop_tails = [0] * len(params.stop)
        self.num_emitted_chars = 0
        self.num_output_tokens = 0
        self.stop_reason: str | int | None = None  # what ended the sequence with "stop": a stop string, or an id

    def run_finish(self, tokens: list[int], num_output_before: int, context_left: int
                   ) -> tuple[int, FinishReason | None]:
        """For tokens sampled in a row after `num_output_before` output tokens, with `context_left` positions
        left in the context: how many the sequence keeps, and the finish the last kept one forces by its id or
        count alone (stop ids after min_tokens, max_tokens, the context's end)."""
        # At least the one token sampled, unless the request asks for none (an echo scoring its prompt alone).
        at_length = max(min(1, self.params.max_tokens), min(self.params.max_tokens - num_output_before, context_left))
        if not self.stop_ids.isdisjoint(tokens):
            for j in range(max(0, self.params.min_tokens - num_output_before), min(len(tokens), at_length)):
                if tokens[j] in self.stop_ids:
                    return j + 1, "stop"
        if at_length <= len(tokens):
            return at_length, "length"
        return len(tokens), None

    def emit_run(self, tokens: list[int], finish: FinishReason | None) -> tuple[str, int, FinishReason | None]:
        """`emit` for a run of tokens whose last alone may carry `finish` (from `run_finish`): (the text that may be
        emitted, how many of the tokens it covers, the finish). A stop string ends the run at its token."""
        if not tokens:  # it ends with none (max_tokens 0)
            return "", 0, finish
        if not self.params.stop:
            self.num_output_tokens += len(tokens)
            # A stop id's own text is not emitted, unless the request includes what stopped it.
            shown = tokens[:-1] if finish == "stop" and not self.params.include_stop_str_in_output else tokens
            if finish == "stop":
                self._stopped_by_id(tokens[-1])
            text = self.detokenizer.push(shown)
            if finish is not None:
                text += self.detokenizer.flush()
            return text, len(tokens), finish
        texts = []
        for j, token in enumerate(tokens):
            decision = self.emit(token, finish if j == len(tokens) - 1 else None)
            texts.append(decision.text)
            if decision.finish_reason is not None:
                return "".join(texts), j + 1, decision.finish_reason
        return "".join(texts), len(tokens), None

    def emit(self, token_id: int, token_finish: FinishReason | None) -> StopDecision:
        """Adds the token's text; `token_finish` is the finish its id or count forces (`run_finish`'s). With
        `include_stop_str_in_output`, the stop string or stop id that ends the sequence is emitted with it, and no
        text is held back (a stop string's beginning may then be emitted before it completes)."""
        self.num_output_tokens += 1
        include = self.params.include_stop_str_in_output
        if token_finish == "stop":
            self._stopped_by_id(token_id)
        if token_finish == "stop" and not include:  # a stop id's own text is not emitted
            self.text += self.detokenizer.flush()
            return StopDecision(self._flush(), "stop")
        text = self.detokenizer.push((token_id,))
        if token_finish is not None:
            text += self.detokenizer.flush()
        before = len(self.text)
        self.text += text
        # A stop id comes first, as in vLLM: its whole text is kept and not searched for stop strings.
        if token_finish != "stop" and self.num_output_tokens > self.params.min_tokens:
            # Only a match that ends in this token's text: one wholly in the text of a token within min_tokens
            # does not stop the sequence (and was emitted). One that starts in the text before it starts in that stop
            # string's tail (`_stop_tails`), so the search need not go back further.
            hits = [(i, i + len(s), s) for s, tail in zip(self.params.stop, self._stop_tails)
                    if (i := self.text.find(s, before - tail)) >= 0]
            if hits:
                start, end, self.stop_reason = min(hits)
                self.text = self.text[:end if include else start]
                return StopDecision(self._flush(), "stop")
        if token_finish is not None:
            return StopDecision(self._flush(), token_finish)
        self._update_stop_tails(len(text))
        end = len(self.text) - (0 if include else max(self._stop_tails, default=0))
        new = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return StopDecision(new)

    def _stopped_by_id(self, token_id: int) -> None:
        """A stop id ended the sequence: the request's own is its stop reason; EOS has none (as in vLLM)."""
        if token_id in self.params.stop_token_ids:
            self.stop_reason = token_id

    def _flush(self) -> str:
        new = self.text[self.num_emitted_chars:]
        self.num_emitted_chars = len(self.text)
        return new

    def _update_stop_tails(self, num_new_chars: int) -> None:
        """`_stop_tails` for the text with `num_new_chars` more characters. A tail can only have grown by those (the
        text before them ended in the rest of it, itself a prefix), so a stop string, however long, is compared
        with the text only for lengths up to its tail before plus the new characters."""
        for k, stop in enumerate(self.params.stop):
            longest = min(len(stop) - 1, len(self.text), self._stop_tails[k] + num_new_chars)
            self._stop_tails[k] = next((n for n in range(longest, 0, -1) if self.text.endswith(stop[:n])), 0)
