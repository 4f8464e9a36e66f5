"""Stop checking on detokenized text with SmolLM2's tokenizer: stop strings across token boundaries, never emitted."""

import random

import pytest

from sluice.batching.sampling_params import SamplingParams
from sluice.batching.stop_checker import StopChecker, StopDecision

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def token_finish(checker: StopChecker, token_id: int, num_output_tokens: int, at_max_model_len: bool = False):
    """The finish a token forces by its id and count alone, one token at a time: the reference for `run_finish`."""
    if num_output_tokens > checker.params.min_tokens and token_id in checker.stop_ids:
        return "stop"
    if num_output_tokens >= checker.params.max_tokens or at_max_model_len:
        return "length"
    return None


def append(checker: StopChecker, token: int) -> StopDecision:
    """`token_finish` then `emit`, for one token."""
    return checker.emit(token, token_finish(checker, token, checker.num_output_tokens + 1))


def feed(tokenizer, text: str, params: SamplingParams, extra: list[int] = ()):
    """Feeds the tokens of `text` (then `extra`) one by one; returns (emitted text, finish reason, tokens used)."""
    checker = StopChecker(params, (EOS,), tokenizer.decode_stream())
    emitted = ""
    ids = tokenizer.encode(text) + list(extra)
    for used, token in enumerate(ids, 1):
        decision = append(checker, token)
        emitted += decision.text
        if decision.finish_reason:
            return emitted, decision.finish_reason, used
    return emitted, None, len(ids)


def test_stop_string_spanning_tokens_is_found_and_not_emitted(tokenizer):
    text = "The capital of France is Paris. It is lovely."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    # a stop string made of the end of one token and the start of the next
    k = next(i for i, p in enumerate(pieces[:-1]) if len(p) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-1] + pieces[k + 1][:2]
    emitted, reason, used = feed(tokenizer, text, SamplingParams(max_tokens=100, stop=(stop,)))
    assert reason == "stop"
    assert emitted == text[:text.index(stop)]
    assert used == k + 2  # stops on the token that completes the stop string


def test_text_that_might_start_a_stop_string_is_held_back_then_released(tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=100, stop=("Paris!",)), (EOS,), tokenizer.decode_stream())
    emitted = ""
    held_back_seen = False
    for token in tokenizer.encode("Hello Paris. Bye"):
        emitted += append(checker, token).text
        if checker.text.endswith("Paris"):
            assert emitted == checker.text[:-len("Paris")]
            held_back_seen = True
    assert held_back_seen and emitted == "Hello Paris. Bye"


def test_length_finish_flushes_held_back_text(tokenizer):
    ids = tokenizer.encode("one two three")
    emitted, reason, _ = feed(tokenizer, "one two three", SamplingParams(max_tokens=len(ids), stop=(" three!",)))
    assert reason == "length" and emitted == "one two three"


def test_the_stop_string_or_stop_ids_text_is_emitted_when_included_and_nothing_is_held_back(tokenizer):
    text = "The capital of France is Paris. It is lovely."
    include = SamplingParams(max_tokens=100, stop=("Paris.",), include_stop_str_in_output=True)
    assert feed(tokenizer, text, include)[:2] == ("The capital of France is Paris.", "stop")
    checker = StopChecker(include, (EOS,), tokenizer.decode_stream())
    assert "".join(append(checker, token).text for token in tokenizer.encode("Hello Paris")) == "Hello Paris"
    there = tokenizer.encode(" there")[-1]
    for included, expected in ((False, "Hi"), (True, "Hi there")):
        params = SamplingParams(max_tokens=20, stop_token_ids=(there,), include_stop_str_in_output=included)
        assert feed(tokenizer, "Hi there", params)[:2] == (expected, "stop")


def test_eos_stops_without_emitting_its_text_unless_ignored(tokenizer):
    emitted, reason, used = feed(tokenizer, "Hi there", SamplingParams(max_tokens=20), extra=[EOS, 100])
    assert (emitted, reason) == ("Hi there", "stop")
    _, reason, used = feed(tokenizer, "Hi there", SamplingParams(max_tokens=20, ignore_eos=True), extra=[EOS, 100])
    assert reason is None


def test_the_stop_reason_is_the_stop_string_that_matched_first_or_the_requests_stop_id_and_none_for_eos(tokenizer):
    text = "Hi there, Paris."
    there = tokenizer.encode(" there")[-1]
    for params, extra, expected in (
        (SamplingParams(max_tokens=20, stop=("Paris", "there,")), [], "there,"),
        (SamplingParams(max_tokens=20, stop=("zzz",), stop_token_ids=(there,)), [], there),
        (SamplingParams(max_tokens=20, stop_token_ids=(there,), include_stop_str_in_output=True), [], there),
        (SamplingParams(max_tokens=20, stop=("zzz",)), [EOS], None),
        (SamplingParams(max_tokens=20, stop=("Hi there, Paris.",)), [EOS], "Hi there, Paris."),
        (SamplingParams(max_tokens=2, stop=("Paris",)), [], None),
    ):
        checker = StopChecker(params, (EOS,), tokenizer.decode_stream())
        for token in [*tokenizer.encode(text), *extra]:
            if append(checker, token).finish_reason is not None:
                break
        assert checker.stop_reason == expected, params


def test_a_stop_id_that_ends_the_output_is_kept_whole_and_its_text_not_searched_for_stop_strings(tokenizer):
    """As vLLM's detokenizer skips the stop-string check on a step a stop token ends: with the stop id's text
    included, a stop string inside it neither cuts that text nor becomes the stop reason."""
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1
    for stop_ids, eos, expected_reason in (((im_end[0],), (), im_end[0]), ((), im_end, None)):
        params = SamplingParams(max_tokens=20, stop=("ld<",), stop_token_ids=stop_ids, include_stop_str_in_output=True)
        checker = StopChecker(params, tuple(eos), tokenizer.decode_stream(skip_special_tokens=False))
        emitted = "".join(checker.emit(token, None).text for token in tokenizer.encode("Hello world"))
        decision = checker.emit(im_end[0], "stop")
        assert (emitted + decision.text, decision.finish_reason) == ("Hello world<|im_end|>", "stop")
        assert checker.stop_reason == expected_reason


def test_min_tokens_defers_stop_strings_and_stop_ids(tokenizer):
    params = SamplingParams(max_tokens=20, min_tokens=5, stop=("a",))
    emitted, reason, used = feed(tokenizer, "a b c d e f a g", params)
    assert reason == "stop" and used > 5


def test_a_stop_string_wholly_within_min_tokens_does_not_stop_later(tokenizer):
    """Text emitted while min_tokens deferred stop strings stays emitted; a match must end after it."""
    x, ab, c = (tokenizer.encode(piece) for piece in ("x", "ab", "c"))
    assert len(x) == len(ab) == len(c) == 1
    params = SamplingParams(max_tokens=20, min_tokens=2, stop=("ab",))
    checker = StopChecker(params, (EOS,), tokenizer.decode_stream())
    decisions = [append(checker, token) for token in (*x, *ab, *c)]
    assert "".join(d.text for d in decisions) == "xabc"
    assert all(d.finish_reason is None for d in decisions)
    # A match that ends past min_tokens still stops, and is not emitted.
    assert append(checker, *ab) == StopDecision("", "stop")


def token_by_token(checker: StopChecker, tokens: list[int], num_output_before: int, context_left: int):
    """(tokens kept, finish, text) as `token_finish` then `emit` decide them one token at a time."""
    text = ""
    for j, token in enumerate(tokens):
        finish = token_finish(checker, token, num_output_before + j + 1, j + 1 >= context_left)
        decision = checker.emit(token, finish)
        text += decision.text
        if decision.finish_reason is not None:
            return j + 1, decision.finish_reason, text
    return len(tokens), None, text


@pytest.mark.parametrize("include", [False, True], ids=["", "including-the-stop"])
@pytest.mark.parametrize("stop", [(), (" blue",)])
def test_a_run_of_tokens_ends_and_reads_as_it_would_token_by_token(tokenizer, stop, include):
    rng = random.Random(len(stop))
    words = tokenizer.encode(" red green blue yellow 東京")  # with tokens that hold part of a character
    for trial in range(300):
        max_tokens = rng.randrange(1, 12)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randrange(0, min(4, max_tokens + 1)), stop=stop,
                                stop_token_ids=(words[0],), include_stop_str_in_output=include)
        tokens = [rng.choice([*words, EOS]) for _ in range(rng.randrange(1, 9))]
        before, context_left = rng.randrange(0, params.max_tokens), rng.randrange(1, 12)
        one, run = (StopChecker(params, (EOS,), tokenizer.decode_stream()) for _ in range(2))
        count, finish = run.run_finish(tokens, before, context_left)
        text, emitted, reason = run.emit_run(tokens[:count], finish)
        expected = token_by_token(one, tokens, before, context_left)
        assert (emitted, reason, text) == expected, (trial, tokens, params, before, context_left)
        assert run.stop_reason == one.stop_reason
        if not stop:
            assert (count, finish) == expected[:2]


@pytest.mark.parametrize("stop", [(), ("zzz",)])
@pytest.mark.parametrize("ending", ["max_tokens", "context", "stop_id"])
def test_a_run_that_ends_mid_character_ends_with_its_held_bytes_as_the_tokenizer_decodes_them(tokenizer, stop,
                                                                                                ending):
    """A sequence cut, or stopped by its stop id, after half a character: the held bytes come out as U+FFFD, so
    the whole text is the tokenizer's decode of the output (the stop id's own text left out)."""
    half = tokenizer.encode("Hi 🦜")[:-1]
    tokens = [*half, EOS] if ending == "stop_id" else half
    params = SamplingParams(max_tokens=len(half) if ending == "max_tokens" else 100, stop=stop)
    checker = StopChecker(params, (EOS,), tokenizer.decode_stream())
    count, finish = checker.run_finish(tokens, 0, len(half) if ending == "context" else 100)
    assert (count, finish) == (len(tokens), "stop" if ending == "stop_id" else "length")
    text = checker.emit_run(tokens[:count - 1], None)[0]
    assert checker.emit_run(tokens[count - 1:], finish) == (" \ufffd", 1, finish)
    assert text + " \ufffd" == tokenizer.decode(tokens) == "Hi \ufffd"


@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_a_token_that_ends_mid_character_emits_its_held_bytes_as_u_fffd(tokenizer, stop):
    half = tokenizer.encode("Hi 🦜")[:-1]
    emitted, reason, _ = feed(tokenizer, "Hi 🦜", SamplingParams(max_tokens=len(half), stop=stop))
    assert (emitted, reason) == ("Hi \ufffd", "length")
    checker = StopChecker(SamplingParams(max_tokens=100, stop=stop), (EOS,), tokenizer.decode_stream())
    assert "".join(append(checker, token).text for token in [*half, EOS]) == "Hi \ufffd"
