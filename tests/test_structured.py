"""Structured output's parts: grammars compiled against the real SmolLM2 vocabulary, their masks (drafts
included), and the sampler applying a mask."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from sluice.batching.sampling_params import RequestRejected
from sluice.batching.sampler import bitmask_words, mask_disallowed, sample
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.batching.structured import GrammarCompiler, InvalidGrammar, fill_bitmask, unmasked_prefixes
from sampling_rows import Row, sampling_batch

IM_START, EOS = 1, 2  # <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    return GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size, (EOS,))


def allowed_ids(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = (bitmask_row[:, None] >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab])


def mask_of(grammar, vocab: int) -> np.ndarray:
    bitmask = np.zeros((1, bitmask_words(vocab)), np.int32)
    fill_bitmask([(grammar, 0, [])], bitmask)
    return allowed_ids(bitmask[0], vocab)


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "strin"}}})),
     "strin"),
    (StructuredOutput("json_schema", json.dumps({"not": {"type": "string"}})), "not"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "format": "weird"})), "weird"),
    (StructuredOutput("json_schema", json.dumps({"$ref": "#/nowhere"})), "nowhere"),
    (StructuredOutput("json_schema", "{not json"), "JSON schema"),
    (StructuredOutput("regex", "[a-z"), "unclosed character class"),
    (StructuredOutput("regex", "(?=x)y"), "look-around"),
    (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
])
def test_invalid_or_unsupported_grammar_is_rejected_naming_the_problem(compiler, spec, problem):
    with pytest.raises(InvalidGrammar, match=problem):
        compiler.compile(spec)


def test_a_check_refuses_what_compile_refuses_and_compiles_each_spec_once(compiler, monkeypatch):
    """Tools' schemas are checked with every request that carries them: an agent's are the same each time."""
    compiled = []
    compile_ = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda spec: compiled.append(spec) or compile_(spec))
    good = StructuredOutput("json_schema", json.dumps({"type": "object",
                                                       "properties": {"checked_once": {"type": "integer"}}}))
    bad = StructuredOutput("regex", "[a-q")
    for _ in range(3):
        compiler.check(good)
        with pytest.raises(InvalidGrammar, match="unclosed character class"):
            compiler.check(bad)
    assert compiled == [good, bad]


def test_a_tokenizer_with_tokens_beyond_the_models_logits_rejects_structured_output(tokenizer):
    with pytest.raises(RequestRejected, match="structured output is not available"):
        GrammarCompiler(tokenizer, 256, (EOS,))


def test_json_text_the_schema_allows_is_accepted_token_by_token_and_eos_only_at_the_end(compiler, tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
              "items": {"enum": ["a", "b"]}}}, "required": ["name", "tags"], "additionalProperties": False}
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps(schema)))
    vocab = compiler.tokenizer.vocab_size
    for token in tokenizer.encode('{"name": "Ada", "tags": ["a", "b"]}'):
        allowed = mask_of(grammar, vocab)
        assert token in allowed and EOS not in allowed
        grammar.advance(token)
    assert list(mask_of(grammar, vocab)) == [EOS]


# What the output starts with before a spec's grammar; its rule NOTE is not the grammar's.
PREAMBLE = 'preamble: "Note: " NOTE\nNOTE: /[a-z]+\\n/\n'


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", json.dumps({"type": "integer"})),
    StructuredOutput("regex", "[0-9]+"),
    StructuredOutput("choice", json.dumps(["42", "no"])),
    StructuredOutput("grammar", "start: NOTE\nNOTE: /[0-9]+/"),
], ids=lambda spec: spec.kind)
def test_a_preamble_comes_before_a_grammar_of_any_kind_whose_rules_stay_its_own(compiler, tokenizer, spec):
    def complete(text: str) -> bool:
        matcher = compiler.compile(dataclasses.replace(spec, preamble=PREAMBLE)).matcher
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    assert complete("Note: hm\n42")
    assert not complete("42") and not complete("Note: hm\nab")


def test_a_grammar_past_llguidances_limits_is_refused_with_a_preamble_as_without(compiler):
    spec = StructuredOutput("choice", json.dumps([f"option {i}" for i in range(2001)]), preamble=PREAMBLE)
    with pytest.raises(InvalidGrammar, match="choice too large"):
        compiler.compile(spec)


def test_a_token_outside_the_grammar_is_refused_loudly(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("regex", r"\d+"))
    with pytest.raises(RuntimeError, match="grammar"):
        grammar.advance(tokenizer.encode("x")[0])


def test_forked_grammars_advance_independently(compiler, tokenizer):
    first = compiler.compile(StructuredOutput("choice", json.dumps(["yes", "no"])))
    second = first.fork()
    first.advance(tokenizer.encode("yes")[0])
    vocab = compiler.tokenizer.vocab_size
    assert list(mask_of(first, vocab)) == [EOS]
    assert tokenizer.encode("no")[0] in mask_of(second, vocab)


def test_draft_rows_get_the_masks_of_the_grammar_after_each_draft_and_the_state_is_rolled_back(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}"))
    drafts = tokenizer.encode("123-45")
    assert grammar.valid_prefix(drafts + tokenizer.encode("x")) == drafts
    vocab = compiler.tokenizer.vocab_size
    bitmask = np.zeros((len(drafts) + 1, bitmask_words(vocab)), np.int32)
    fill_bitmask([(grammar, 0, drafts)], bitmask)
    stepwise = grammar.fork()
    for j in range(len(drafts) + 1):
        np.testing.assert_array_equal(allowed_ids(bitmask[j], vocab), mask_of(stepwise, vocab))
        if j < len(drafts):
            stepwise.advance(drafts[j])
    np.testing.assert_array_equal(mask_of(grammar, vocab), allowed_ids(bitmask[0], vocab))


def test_tokens_drawn_without_the_mask_stand_while_the_text_was_free_and_a_first_that_falls_keeps_none(compiler,
                                                                                                      tokenizer):
    """A multi-step call's rows under grammars that leave the text free (`Engine._draws_unmasked`): each keeps the
    tokens drawn while the text was free and its grammar took them; a row whose first token fell (a special token
    that free text does not take) keeps none and draws its next under the mask, even when no row kept any."""
    spec = StructuredOutput("grammar", 'start: TEXT | head "!!"\nhead[lazy]: TEXT "<call>"\nTEXT: /(.|\\n)*/\n',
                            mostly_free=True)  # no token of SmolLM2's holds "<call>" but at its end
    text = tokenizer.encode("Sure. <call>!! and more")
    # Up to "<call": the ">" after it is drawn where the text is no longer free (">>" is ruled out).
    upto_word = tokenizer.encode("Sure. <call")
    assert text[:len(upto_word) + 1] == tokenizer.encode("Sure. <call>")
    fresh = [compiler.compile(spec) for _ in range(3)]
    assert all(grammar.allows_free_text() for grammar in fresh)
    for rows, kept in [([(fresh[0], [IM_START, *text])], [0]),
                       ([(fresh[1], text), (fresh[2], [IM_START, *text])], [len(upto_word), 0])]:
        assert unmasked_prefixes(rows) == kept
        for (grammar, tokens), count in zip(rows, kept):  # as the engine appends those that stand
            for token in tokens[:count]:
                grammar.advance(token)
        assert [grammar.masked_next for grammar, _ in rows] == [True] * len(rows)
    assert unmasked_prefixes([]) == []


def test_a_token_drawn_without_the_mask_that_fell_after_some_that_stood_is_drawn_under_it_next(compiler, tokenizer):
    """The engine advances the grammar over the tokens that stood (`Engine._append`): the one that fell after them,
    a special token that free text does not take, is drawn under the mask next, not again without it (a multi-step
    call that would keep nothing of the row); once a token is taken there, the text is drawn unmasked again."""
    spec = StructuredOutput("grammar", "start: TEXT\nTEXT: /(.|\\n)*/\n", mostly_free=True)
    grammar = compiler.compile(spec)
    stood = tokenizer.encode("Sure.")
    assert unmasked_prefixes([(grammar, [*stood, IM_START, *tokenizer.encode(" Ok")])]) == [len(stood)]
    for token in stood:
        grammar.advance(token)
    assert grammar.masked_next and grammar.fork().masked_next and grammar.allows_free_text()
    grammar.advance(tokenizer.encode(" Ok")[0])
    assert not grammar.masked_next


def test_masked_rows_sample_and_report_only_allowed_tokens_and_all_ones_rows_are_untouched():
    vocab, num_rows = 100, 3
    logits = jax.random.normal(jax.random.key(0), (num_rows, vocab)) * 3
    params = [SamplingParams(temperature=0.0, top_logprobs=5), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0, top_logprobs=5)]
    batch = sampling_batch([Row(p, 7) for p in params], num_rows, vocab, 4)
    allowed_tokens = [3, 40, 63, 97]
    allowed = np.full((num_rows, bitmask_words(vocab)), -1, np.int32)
    allowed[:2] = 0
    for token in allowed_tokens:
        allowed[:2, token // 32] |= np.array(1 << (token % 32), np.uint32).view(np.int32)
    free = jax.tree.map(np.asarray, jax.jit(sample)(logits, batch))
    out = jax.tree.map(np.asarray, jax.jit(lambda x, m, b: sample(mask_disallowed(x, m), b))(logits, allowed, batch))
    best = allowed_tokens[int(np.argmax(np.asarray(logits)[0, allowed_tokens]))]
    assert out.tokens[0] == best and out.tokens[1] in allowed_tokens
    assert set(out.top_ids[0, :4]) == set(allowed_tokens) and np.isneginf(out.top_logprobs[0, 4])
    np.testing.assert_allclose(np.exp(out.top_logprobs[0, :4]).sum(), 1.0, rtol=1e-5)
    assert out.tokens[2] == free.tokens[2] and np.array_equal(out.top_ids[2], free.top_ids[2])
