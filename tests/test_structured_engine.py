"""Structured output with the engine's speed features: speculative decoding (drafts verified under the mask,
the grammar never left holding a rejected draft), multi-step decode (constrained batches run single steps, but for
grammars that leave the text free, whose tokens a call draws unmasked and the host checks) and overlapped
scheduling (a step's masks wait for the step before). A tiny random model over SmolLM2's full
vocabulary, so every token id has a logit."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from flax import nnx

from sluice.app.reasoning import ReasoningFormat
from sluice.app.tool_calls import call_grammar
import sluice.batching.engine as engine_module
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Completion
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from test_engine_overlap import fed_steps
from test_speculative import free_verification


CONFIG = EngineConfig(max_num_seqs=8, spec_max_batch_size=8, max_num_batched_tokens=64, max_model_len=160, page_size=4,
                      kv_cache_memory=8 << 20, num_decode_steps=1, warmup=False)
# Greedy decoding of a random model settles into cycles, which n-gram drafts then follow.
PATTERN = r"(ab|cd|ef)+\."
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=60, logprobs=True,
                             structured=StructuredOutput("regex", PATTERN))
PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [30, 31, 32, 33, 34, 35], [100, 5, 100, 5, 100], [60, 61, 62]]
EOS = 2  # ModelConfig.tiny's


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    config = ModelConfig.tiny(vocab_size=smollm2.tokenizer.vocab_size)
    return LoadedModel(config, Llama(config, rngs=nnx.Rngs(1)), smollm2.tokenizer, "tiny")


@pytest.fixture(scope="module")
def plain(tiny) -> Engine:
    return Engine(tiny, CONFIG, progress=False)


def test_speculative_decoding_under_a_grammar_gives_the_tokens_of_plain_decoding(tiny, plain):
    speculative = free_verification(Engine(tiny, replace(CONFIG, speculative="ngram"), progress=False))
    want = plain.generate(PROMPTS, CONSTRAINED)
    have = speculative.generate(PROMPTS, CONSTRAINED)
    for w, h in zip(want, have):
        assert h[0].token_ids == w[0].token_ids and h[0].finish_reason == w[0].finish_reason == "stop"
        assert re.fullmatch(PATTERN, h[0].text)
    counters = speculative.speculator.counters()
    assert counters.num_accepted_tokens > 20 and counters.num_accepted_tokens < counters.num_draft_tokens
    assert speculative.stats.kv_pages_used == 0


def test_multi_step_decode_runs_constrained_batches_one_step_per_call_with_the_same_tokens(tiny, plain):
    multi = Engine(tiny, replace(CONFIG, num_decode_steps=4), progress=False)
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params = [CONSTRAINED, free, CONSTRAINED, free]
    before = plain.stats.num_steps
    want = plain.generate(PROMPTS, params)
    have = multi.generate(PROMPTS, params)
    assert [h[0].token_ids for h in have] == [w[0].token_ids for w in want]
    assert multi.stats.num_steps == plain.stats.num_steps - before
    steps = multi.stats.num_steps
    alone = multi.generate(PROMPTS[1::2], free)
    assert [a[0].token_ids for a in alone] == [w[0].token_ids for w in want[1::2]]
    assert multi.stats.num_steps - steps < free.max_tokens // 2  # alone, they decode 4 tokens per call


def test_overlapped_steps_with_grammars_give_the_tokens_of_collecting_every_step_first(tiny, plain):
    """Overlapped (most of the batch free), a step with constrained rows is dispatched before the host has the
    tokens of the step before; their masks are filled, and the step's sampling dispatched, once it has. A token
    the grammar forces is then sampled (its mask allows it alone) instead of appended at once: the same tokens,
    seeded draws included. A sequence the step before ended (its grammar complete) has its row in flight
    dropped."""
    serial = Engine(tiny, replace(CONFIG, async_scheduling=False), progress=False)
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    params = [CONSTRAINED,
              SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutput("json_schema",
                                                                                         json.dumps(colour))),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured=StructuredOutput("regex", PATTERN)),
              *[SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3]
    prompts = [*PROMPTS, [11, 12, 13], [90, 91]]
    overlapped: list[bool] = []
    dispatch = plain.runner.dispatch

    def recording(chunks, *args, **kwargs):
        overlapped.append(any(c.seq.num_pending and c.seq.grammar is not None for c in chunks))
        return dispatch(chunks, *args, **kwargs)

    plain.runner.dispatch = recording
    try:
        have = plain.generate(prompts, params)
    finally:
        plain.runner.dispatch = dispatch
    want = serial.generate(prompts, params)
    for w, h in zip(want, have):
        assert (h[0].token_ids, h[0].text, h[0].finish_reason) == (w[0].token_ids, w[0].text, w[0].finish_reason)
    assert json.loads(have[1][0].text)["colour"] in ("red", "green") and have[1][0].finish_reason == "stop"
    assert sum(overlapped) > 20
    assert plain.stats.kv_pages_used == 0


def test_a_batch_all_under_grammars_that_leave_the_text_free_overlaps_its_steps(tiny, plain):
    """tool_choice auto's call grammar leaves the text free until a call opens (`mostly_free`): a batch all under
    it is overlapped as a free one would be; under the same grammar not so marked, collected first (a grammar
    that forces tokens appends them at once then). The same tokens either way."""
    chosen = call_grammar([("add", {"type": "object", "properties": {"a": {"type": "integer"}}})], parallel=True,
                          after_text=True)
    dispatch = plain.runner.dispatch
    overlapped = fed_steps(plain)
    try:
        runs = []
        for grammar in (chosen, replace(chosen, mostly_free=False)):
            overlapped.clear()
            params = SamplingParams(temperature=0.0, max_tokens=20, structured=grammar)
            runs.append(([out[0].token_ids for out in plain.generate(PROMPTS, params)], sum(overlapped)))
    finally:
        plain.runner.dispatch = dispatch
    (free_tokens, free_overlapped), (forcing_tokens, forcing_overlapped) = runs
    assert free_tokens == forcing_tokens and free_overlapped > 10 and forcing_overlapped == 0
    assert plain.stats.kv_pages_used == 0


def test_multi_step_calls_draw_the_tokens_of_a_grammar_that_leaves_the_text_free_and_keep_those_it_takes(tiny,
                                                                                                         plain):
    """While a grammar allows every token free text does (tool_choice auto's calls before their tag), a multi-step
    call draws its rows' tokens without the mask, and the host keeps those drawn while the text was still free:
    greedy, the tokens of single masked steps, in fewer steps. Here the text turns into calls at a word the model
    writes a few tokens in (found from its free reply), after which the grammar forces `!!` and the end: the
    tokens the call drew past the word are dropped, the forced ones appended, and nothing leaks."""
    multi = Engine(tiny, replace(CONFIG, num_decode_steps=4), progress=False)
    tokenizer = tiny.tokenizer
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    vocabulary = [tokenizer.token_text(token) for token in range(tokenizer.vocab_size)]
    words = []
    for reply in plain.generate(PROMPTS[:2], free):
        texts = [tokenizer.token_text(token) for token in reply[0].token_ids]
        # A word no token holds but at its end: no token is ruled out while the text is free.
        words.append(next(texts[j] for j in range(2, len(texts)) if re.fullmatch(r" ?[a-z]{3,}", texts[j])
                          and texts[j] not in "".join(texts[:j])
                          and not any(texts[j] in text and not text.endswith(texts[j]) for text in vocabulary)))
    chosen = call_grammar([("add", {"type": "object", "properties": {"a": {"type": "integer"}}})], parallel=True,
                          after_text=True)
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutput(
        "grammar", f'start: TEXT | head "!!"\nhead[lazy]: TEXT {json.dumps(word)}\nTEXT: /(.|\\n)*/\n',
        mostly_free=True)) for word in words]
    params += [SamplingParams(temperature=0.0, max_tokens=30, structured=chosen)] * 2
    single_steps = plain.stats.num_steps
    want = plain.generate(PROMPTS, params)
    single_steps = plain.stats.num_steps - single_steps
    have = multi.generate(PROMPTS, params)
    for w, h in zip(want, have):
        assert (h[0].token_ids, h[0].text, h[0].finish_reason) == (w[0].token_ids, w[0].text, w[0].finish_reason)
    for reply, word in zip(have, words):
        assert reply[0].text.endswith(word + "!!") and reply[0].finish_reason == "stop"
    assert multi.stats.num_steps < single_steps * 2 // 3
    assert multi.stats.kv_pages_used == 0


def test_multi_step_calls_draw_a_thoughts_tokens_unmasked_and_an_eos_drawn_there_falls(tiny, plain, monkeypatch):
    """A reasoning model's thought allows every token free text does but EOS (the reply may not end inside it), so
    a multi-step call draws it without the mask too; an EOS drawn there falls, and the next token is drawn under
    the mask. With EOS's logit raised it is often the greedy choice: the tokens of single masked steps still, in
    fewer steps."""
    multi = Engine(tiny, replace(CONFIG, num_decode_steps=4), progress=False)
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    spec = StructuredOutput("json_schema", json.dumps(colour),
                            preamble=ReasoningFormat.named("deepseek_r1").preamble(tiny.tokenizer))
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=spec, logit_bias=((EOS, 3.0),))
    fell = []
    check = engine_module.unmasked_prefixes

    def recording(rows):
        standing = check(rows)
        fell.extend(tokens[count] for (_, tokens), count in zip(rows, standing) if count < len(tokens))
        return standing

    monkeypatch.setattr(engine_module, "unmasked_prefixes", recording)
    single_steps = plain.stats.num_steps
    want = plain.generate(PROMPTS, params)
    single_steps = plain.stats.num_steps - single_steps
    have = multi.generate(PROMPTS, params)
    for w, h in zip(want, have):
        assert (h[0].token_ids, h[0].text, h[0].finish_reason) == (w[0].token_ids, w[0].text, "length")
        assert EOS not in h[0].token_ids
    assert fell.count(EOS) >= len(PROMPTS)
    assert multi.stats.num_steps < single_steps * 3 // 4
    assert multi.stats.kv_pages_used == 0


def test_a_seeded_sampling_rows_tokens_under_a_mostly_free_grammar_do_not_depend_on_multi_step_calls(tiny, plain):
    """Drawn from the whole distribution in a multi-step call, a token of free text is the masked draw's equal in
    distribution, but not for the same seed: with this model's nearly flat logits, a mask that leaves out the
    special tokens and EOS moved every seeded draw. A seeded sampling row runs in single masked steps, so its
    tokens are those it gets in a batch that never allows a multi-step call; an unseeded one still joins the
    calls."""
    multi = Engine(tiny, replace(CONFIG, num_decode_steps=4), progress=False)
    texts = StructuredOutput("grammar", "start: TEXT\nTEXT: /(.|\\n)*/\n", mostly_free=True)
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
    thought = StructuredOutput("json_schema", json.dumps(colour),
                               preamble=ReasoningFormat.named("deepseek_r1").preamble(tiny.tokenizer))
    for spec in (texts, thought):
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured=spec, logit_bias=((EOS, 2.0),))
        want = plain.generate(PROMPTS, seeded)
        assert [h[0].token_ids for h in multi.generate(PROMPTS, seeded)] == [w[0].token_ids for w in want]
    steps = multi.stats.num_steps
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, structured=texts)
    assert all(len(reply[0].token_ids) == 24 for reply in multi.generate(PROMPTS[:1], unseeded))
    assert multi.stats.num_steps - steps < 24 // 2
    assert multi.stats.kv_pages_used == 0


def test_a_grammar_check_that_fails_ends_its_own_requests_and_no_other(tiny, plain, monkeypatch):
    """The host's check of a multi-step call's unmasked grammar rows (`unmasked_prefixes`) is host work of those
    requests alone: should it raise, they end with the error, while the free request beside them, whose step went
    well, runs on to the tokens it has alone, and nothing leaks."""
    multi = Engine(tiny, replace(CONFIG, num_decode_steps=4), progress=False)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutput(
        "grammar", "start: TEXT\nTEXT: /(.|\\n)*/\n", mostly_free=True))
    want = plain.generate(PROMPTS[1:2], free)[0][0]

    def broken(rows):
        raise RuntimeError("the grammar check broke")

    monkeypatch.setattr(engine_module, "unmasked_prefixes", broken)
    failed, ran = (reply[0] for reply in multi.generate(PROMPTS[:2], [texts, free]))
    assert failed.finish_reason == "error" and "the grammar check broke" in failed.error
    assert (ran.token_ids, ran.finish_reason) == (want.token_ids, "length")
    assert multi.healthy and multi.stats.kv_pages_used == 0


# Three ordinary tokens of SmolLM2's vocabulary; the grammar forces A, then B, then takes any number of C.
A, B, C = 100, 200, 300
FORCING = StructuredOutput("grammar", f"start: <[{A}]> <[{B}]> <[{C}]>*")
NO_TOKEN_LEFT = "the grammar allows no token in allowed_token_ids here"


@pytest.fixture(scope="module")
def serial(tiny) -> Engine:
    return Engine(tiny, replace(CONFIG, async_scheduling=False), progress=False)


def beside_a_free_request(engine: Engine, params: SamplingParams) -> Completion:
    """`params`' completion of a prompt in a batch whose other request is free: overlapped scheduling (the
    default) then dispatches the constrained row's steps before the host has its tokens."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return engine.generate(PROMPTS[:2], [params, free])[0][0]


@pytest.mark.parametrize(("allowed", "emitted"), [((A, C), (A,)), ((C,), ())], ids=["forced later", "forced first"])
def test_a_token_the_grammar_forces_outside_allowed_token_ids_ends_the_choice_with_an_error(plain, serial, allowed,
                                                                                          emitted, monkeypatch):
    """Whether the host appends a forced token at once (collecting first) or samples it under a one-token mask
    (overlapped), a token allowed_token_ids excludes is never emitted: the choice ends there, its own doing, not the
    model's (its pages stay cached)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=allowed, structured=FORCING)
    for engine in (plain, serial):
        monkeypatch.setattr(engine, "_forget_pages", lambda seq: pytest.fail("pages forgotten"))
        have = beside_a_free_request(engine, params)
        assert (have.token_ids, have.finish_reason, have.error) == (emitted, "error", NO_TOKEN_LEFT)
        assert engine.stats.kv_pages_used == 0


def test_where_the_grammar_allows_only_tokens_allowed_token_ids_excludes_none_of_them_is_sampled(plain, serial):
    """The grammar allows token 0 or A, allowed_token_ids only C: the sampler's masks leave the row no token, and
    its argmax over nothing is no license to emit token 0."""
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=(C,),
                            structured=StructuredOutput("grammar", f"start: (<[0]> | <[{A}]>) <[{C}]>*"))
    for engine in (plain, serial):
        have = beside_a_free_request(engine, params)
        assert (have.token_ids, have.finish_reason, have.error) == ((), "error", NO_TOKEN_LEFT)


def test_allowed_token_ids_that_take_the_forced_tokens_get_them_overlapped_or_not(plain, serial):
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=(A, B, C), structured=FORCING)
    for engine in (plain, serial):
        have = beside_a_free_request(engine, params)
        assert (have.token_ids, have.finish_reason) == ((A, B, *[C] * 6), "length")


def test_an_eos_let_through_before_min_tokens_ends_the_reply(plain, serial):
    """After A the grammar allows B or EOS, and allowed_token_ids only EOS of them: the sampler lifts min_tokens' ban
    of EOS there (the row may take nothing else), and that EOS ends the reply, as a stop id that nothing else could
    follow. It used to be taken as a token like any other, and EOS repeated up to min_tokens."""
    eos = plain.limits.eos_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, allowed_token_ids=(A, eos),
                            structured=StructuredOutput("grammar", f"start: <[{A}]> <[{B}]>?"))
    for engine in (plain, serial):
        have = beside_a_free_request(engine, params)
        assert (have.token_ids, have.finish_reason) == ((A, eos), "stop")


def test_speculative_drafts_stop_where_the_grammar_allows_no_token_in_allowed_token_ids(tiny, plain):
    """The grammar takes six of A or B, then C; a bias picks A, and the prompt of As drafts A past the sixth: the
    row after the last accepted draft samples nothing, and the choice ends there as without drafts."""
    speculative = free_verification(Engine(tiny, replace(CONFIG, speculative="ngram"), progress=False))
    either = f"(<[{A}]> | <[{B}]>) "
    params = SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=(A, B), logit_bias=((A, 50.0),),
                            structured=StructuredOutput("grammar", f"start: {either * 6}<[{C}]>"))
    for engine in (plain, speculative):
        have = engine.generate([[A] * 8], params)[0][0]
        assert (have.token_ids, have.finish_reason, have.error) == ((A,) * 6, "error", NO_TOKEN_LEFT)
    assert speculative.speculator.counters().num_accepted_tokens > 1


def test_drafts_through_a_token_the_grammar_forces_leave_its_matcher_where_it_was(tiny, plain):
    """After A the grammar forces B, a token of its own (`<[id]>`, as a thinking budget's </think> is), and the prompt
    drafts B, A: llguidance rolled its matcher back wrong over the forced draft, which then refused B. Logprobs keep
    the forced B from being appended at once, so it is drafted."""
    speculative = free_verification(Engine(tiny, replace(CONFIG, speculative="ngram"), progress=False))
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True, logit_bias=((A, 5.0),),
                            structured=StructuredOutput("grammar", f"start: (<[{A}]> <[{B}]> | <[{C}]>){{1,4}}"))
    want = plain.generate([[A, B] * 4], params)[0][0]
    have = speculative.generate([[A, B] * 4], params)[0][0]
    assert (have.token_ids, have.finish_reason) == (want.token_ids, want.finish_reason) == ((A, B) * 4 + (2,), "stop")
    assert speculative.speculator.counters().num_accepted_tokens > 1
