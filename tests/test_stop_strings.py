"""Stop strings searched in a sequence's text: the work each token costs is in its new text, whatever the stop."""

from __future__ import annotations

import pytest

from sluice.batching.sampling_params import SamplingParams
from sluice.batching.stop_checker import StopChecker

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


class CountedStop(str):
    """A stop string that counts the prefixes taken of it (`stop[:n]`, one comparison with the text each)."""

    prefixes_taken = 0

    def __getitem__(self, key):
        CountedStop.prefixes_taken += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("include", [False, True])
def test_a_long_stop_string_is_compared_with_each_tokens_new_text_not_the_whole_text(tokenizer, include):
    """One request's stop strings (up to 16, of any length) are searched on the engine thread every step: a
    comparison per character of the text so far, at each token, would stall every request in the batch."""
    stop = CountedStop("x" * 10_000 + "!")
    checker = StopChecker(SamplingParams(max_tokens=1_000, stop=(stop,), include_stop_str_in_output=include),
                          (EOS,), tokenizer.decode_stream())
    text = "hello world, " * 40
    CountedStop.prefixes_taken = 0
    emitted = "".join(checker.emit(token, None).text for token in tokenizer.encode(text))
    assert emitted == text
    assert CountedStop.prefixes_taken <= len(text)


def test_text_held_back_for_a_stop_string_grows_with_the_text_and_is_found_across_tokens(tokenizer):
    stop = "ab" * 50 + "!"
    checker = StopChecker(SamplingParams(max_tokens=1_000, stop=(stop,)), (EOS,), tokenizer.decode_stream())
    emitted = "".join(checker.emit(token, None).text for token in tokenizer.encode("Hi " + "ab" * 60))
    assert emitted == "Hi " + "ab" * 10  # the last 100 characters could yet start the stop string
    decision = checker.emit(tokenizer.encode("!")[0], None)
    assert decision.finish_reason == "stop" and decision.text == "" and checker.stop_reason == stop
