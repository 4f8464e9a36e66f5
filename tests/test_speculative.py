"""Speculative decoding (n-gram drafts, exact verification): same greedy output, same sampling distribution,
stops inside accepted runs, and every page returned."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.ngram import NgramConfig, NgramProposer, propose_on_device
from sluice.batching.sampler import SamplerOutput, sample
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.speculation import drafts_worth_checking, per_draft_rate
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from sampling_rows import Row, sampling_batch

TINY = ModelConfig.tiny()
# Without warm-up: each engine compiles the buckets its tests meet, not every one.
CONFIG = EngineConfig(num_decode_steps=1, max_num_seqs=8, spec_max_batch_size=8, max_num_batched_tokens=64,
                      max_model_len=160, page_size=4, warmup=False,
                      kv_cache_memory=512 * 2 * TINY.num_layers * TINY.num_kv_heads * 4 * TINY.head_dim * 4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)
# Greedy decoding of a random model settles into cycles: n-gram drafts then match, as they do on copy-heavy text.
PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [30, 31, 32, 33, 34, 35], [100, 5, 100, 5, 100], [60, 61, 62]]


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    return LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(1)), smollm2.tokenizer, "tiny")


def free_verification(engine: Engine) -> Engine:
    """Makes every draft worth verifying at any batch size, as on a machine where extra rows cost nothing."""
    engine.speculator.config = replace(engine.speculator.config, row_cost=0.0)
    return engine


@pytest.fixture(scope="module")
def plain(tiny) -> Engine:
    return Engine(tiny, CONFIG, progress=False)


@pytest.fixture(scope="module", params=[(1, "device"), (4, "device"), (4, "host")],
                ids=["verify-steps", "drafts-in-multi-step-calls", "drafts-in-multi-step-calls-host-plans"])
def speculative(tiny, request) -> Engine:
    """Drafts verified in single steps, or (4 decode steps per call) checked 4 per step inside multi-step calls
    whenever every running sequence decodes, the sampler's branches decided on the device or by the host (as
    on a GPU: `SamplerPlan`, warmed up as a GPU's server is: a plan met first runs single steps while its
    multi-step call compiles aside)."""
    num_decode_steps, sampler_branches = request.param
    config = replace(CONFIG, speculative="ngram", num_speculative_tokens=4, num_decode_steps=num_decode_steps,
                     sampler_branches=sampler_branches, warmup=sampler_branches == "host")
    # Warm-up compiles the plan of sampling rows (the seeded tests'); greedy rows' compiles while the first greedy
    # test waits for it.
    warm_for = [SamplingParams(temperature=1.0)]
    return free_verification(Engine(tiny, config, progress=False, warm_for=warm_for))


def test_proposer_continues_the_longest_suffix_seen_before():
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=3, min_n=1, max_n=3))
    proposer.extend([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert proposer.propose(3) == [4, 9, 2]  # "1 2 3" matched before "4 9 2"; not the later "2 3 5"
    assert proposer.propose(10) == [4, 9, 2, 3, 5, 1, 2, 3]  # as far as the tokens go
    proposer.extend([8])
    assert proposer.propose(10) == []  # "8" never occurred before


@pytest.mark.parametrize("config", [NgramConfig(4, 1, 4), NgramConfig(3, 2, 3)])
def test_the_device_proposes_what_the_host_proposer_does(config):
    rng = np.random.default_rng(0)
    histories = np.full((300, 48), -1, np.int32)
    want = []
    for row in histories:
        tokens = rng.integers(0, 5, rng.integers(1, 40)).tolist()  # few distinct tokens: many matches
        row[:len(tokens)] = tokens
        proposer = NgramProposer(config)
        proposer.extend(tokens)
        want.append(proposer.propose(config.num_speculative_tokens))
    drafts, num_drafts = jax.jit(propose_on_device, static_argnums=1)(jnp.asarray(histories), config)
    assert [row[:n] for row, n in zip(np.asarray(drafts).tolist(), np.asarray(num_drafts))] == want
    assert sum(map(len, want)) > 300


def test_greedy_output_and_logprobs_are_identical_with_and_without_drafts(plain, speculative):
    if speculative.runner.plans_on_host:  # a plan met first runs single steps while its call compiles aside
        speculative.generate(PROMPTS, GREEDY)
        speculative.runner.wait_for_compiles()
    before = speculative.speculator.counters()
    expected = plain.generate(PROMPTS, GREEDY)
    got = speculative.generate(PROMPTS, GREEDY)
    for want, have in zip(expected, got):
        assert have[0].token_ids == want[0].token_ids and have[0].finish_reason == want[0].finish_reason
        np.testing.assert_allclose([lp.logprob for lp in have[0].logprobs], [lp.logprob for lp in want[0].logprobs],
                                   atol=1e-4)
        assert [lp.top[0][0] for lp in have[0].logprobs] == [lp.top[0][0] for lp in want[0].logprobs]
    after = speculative.speculator.counters()
    assert after.num_accepted_tokens - before.num_accepted_tokens > 20  # the drafts did the work
    assert speculative.stats.kv_pages_used == 0


def test_stop_string_and_max_tokens_inside_an_accepted_run(plain, speculative):
    free = plain.generate([PROMPTS[0]], GREEDY)[0][0]
    stop = free.text[12:14]
    for params in (replace(GREEDY, stop=(stop,)), replace(GREEDY, max_tokens=13),
                   replace(GREEDY, stop_token_ids=(free.token_ids[9],))):
        want = plain.generate([PROMPTS[0]], params)[0][0]
        have = speculative.generate([PROMPTS[0]], params)[0][0]
        assert (have.text, have.token_ids, have.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert have.usage == want.usage
    assert speculative.stats.kv_pages_used == 0


def test_n_samples_and_aborts_mid_run_leak_no_page(speculative):
    params = SamplingParams(temperature=0.8, max_tokens=30, n=3, seed=4, ignore_eos=True)
    outs = speculative.generate([PROMPTS[2]], params)[0]
    assert len(outs) == 3 and all(len(o.token_ids) == 30 for o in outs)

    async def run():
        await speculative.start()
        try:
            collectors = [speculative.add_request([p], replace(GREEDY, max_tokens=120)) for p in PROMPTS]
            for collector in collectors:
                await anext(aiter(collector))
                speculative.abort(collector.request_id)
            for collector in collectors:
                async for _ in collector:
                    pass
            for _ in range(200):
                if speculative.stats.kv_pages_used == 0 and speculative.stats.num_requests_running == 0:
                    break
                await asyncio.sleep(0.01)
            return speculative.stats
        finally:
            await speculative.shutdown()

    stats = asyncio.run(run())
    assert stats.kv_pages_used == 0 and stats.num_requests_running == 0


def test_verified_sampling_emits_the_model_distribution_whatever_the_draft():
    """Rows verifying a draft d emit the tokens they draw without it (the same seeds), distributed as p
    (chi-square), and keep d where they draw it: with probability p(d), for a likely and an unlikely draft."""
    vocab, num_rows = 64, 6000
    probs = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04] + [0.0] * (vocab - 6))
    logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32) + 1e-30), (num_rows, 1))
    params = SamplingParams(temperature=1.0)

    def sampled(draft: int) -> SamplerOutput:
        rows = [Row(params, seed, tokens=(1,), num_prompt=1, draft=draft) for seed in range(num_rows)]
        return jax.tree.map(np.asarray, jax.jit(sample)(logits, sampling_batch(rows, num_rows, vocab, 4)))

    undrafted = sampled(-1)
    for draft in (0, 4):
        out = sampled(draft)
        np.testing.assert_array_equal(out.tokens, undrafted.tokens)
        counts = np.bincount(out.tokens, minlength=vocab)[:6]
        expected = probs[:6] * num_rows
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < chi2_critical(5), (draft, counts)
        np.testing.assert_array_equal(out.accepted, out.tokens == draft)
        assert out.accepted.mean() == pytest.approx(probs[draft], abs=0.03)


def test_seeded_generations_are_the_same_tokens_with_and_without_drafts(plain, speculative):
    """Over a fixed set of seeds, at a temperature where they spread, drafts change no sampled token: a drafted
    row emits the token its seed draws without the draft. The prompt holds half the vocabulary once each, so a
    sampled token has often been seen and drafts what followed it."""
    prompt = list(range(10, 130))
    params = [SamplingParams(temperature=0.2, max_tokens=4, seed=seed, ignore_eos=True) for seed in range(300)]
    drafted_before = speculative.speculator.counters().num_draft_tokens

    def generate(engine: Engine) -> list[tuple[int, ...]]:
        # In groups the batch holds, so no request waits once they decode: a multi-step engine then drafts inside
        # its calls.
        size = CONFIG.max_num_seqs
        return [o[0].token_ids[1:] for i in range(0, len(params), size)
                for o in engine.generate([prompt] * len(params[i:i + size]), params[i:i + size])]

    tokens = [generate(engine) for engine in (plain, speculative)]
    assert speculative.speculator.counters().num_draft_tokens - drafted_before > 100
    assert all(len({t[position] for t in tokens[0]}) >= 3 for position in range(3)), "the seeds must spread"
    assert tokens[0] == tokens[1]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (z = 3.09), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_a_sequence_checks_the_drafts_likely_enough_to_pay_for_their_rows():
    """Alone, a draft pays if kept with probability at least the row cost (0.1); in a step of 4, 0.4 / 1.3."""
    assert [drafts_worth_checking(alpha, 4, 1, 0.1) for alpha in (1.0, 0.8, 0.5, 0.3, 0.0)] == [4, 4, 3, 1, 0]
    assert [drafts_worth_checking(alpha, 4, 4, 0.1) for alpha in (1.0, 0.8, 0.5, 0.3, 0.0)] == [4, 4, 1, 0, 0]
    assert drafts_worth_checking(0.9, 8, 1, 0.1) == 8 and drafts_worth_checking(0.7, 8, 1, 0.1) == 6
    assert drafts_worth_checking(0.01, 4, 64, 0.0) == 4  # rows that cost nothing: every draft


def test_a_verification_counts_the_drafts_it_reached():
    assert per_draft_rate(4, 4) == 1.0 and per_draft_rate(0, 3) == 0.0 and per_draft_rate(2, 4) == pytest.approx(2 / 3)


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_a_batch_above_the_cutoff_drafts_nothing(tiny, num_decode_steps):
    config = replace(CONFIG, speculative="ngram", spec_max_batch_size=3, num_decode_steps=num_decode_steps)
    engine = Engine(tiny, config, progress=False)
    outs = engine.generate([PROMPTS[0]] * 4, replace(GREEDY, max_tokens=12))
    assert engine.speculator.counters().num_drafts == 0 and all(len(o[0].token_ids) == 12 for o in outs)
    engine.generate([PROMPTS[0]] * 3, replace(GREEDY, max_tokens=12))
    assert engine.speculator.counters().num_drafts > 0


def test_drafts_checked_inside_multi_step_calls_save_calls(tiny, plain):
    """One repeating sequence: the same tokens as without drafts, in fewer calls than 4 tokens per call."""
    engine = free_verification(Engine(tiny, replace(CONFIG, speculative="ngram", num_decode_steps=4), progress=False))
    params = replace(GREEDY, max_tokens=40)
    want = plain.generate([PROMPTS[2]], params)[0][0]
    have = engine.generate([PROMPTS[2]], params)[0][0]
    assert (have.token_ids, have.finish_reason) == (want.token_ids, want.finish_reason)
    # Without drafts: a prefill step, then 39 tokens 4 per call.
    assert engine.speculator.counters().num_accepted_tokens > 10 and engine.stats.num_steps < 1 + 39 / 4
    assert engine.stats.kv_pages_used == 0


COPY_TEXT = (
    "The river carried salt, wool and news down to the sea; the towns along it grew rich on the trade, and "
    "their markets opened at dawn when the first boats arrived."
)


@pytest.mark.slow
def test_real_model_gives_the_same_greedy_tokens_with_drafts_on_golden_and_copy_heavy_prompts(smollm2):
    cases = json.loads((Path(__file__).parent / "data" / "golden_smollm2.json").read_text())["cases"]
    chat = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this sentence exactly: {COPY_TEXT}"}])
    prompts = [case["prompt_ids"] for case in cases] + [smollm2.tokenizer.encode(chat)]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=320, kv_cache_memory=64 << 20,
                          num_decode_steps=1, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=True)
    plain = Engine(smollm2, config, progress=False).generate(prompts, params)
    # Drafts proposed and checked inside 8-step calls, and verified in single steps while the fifth prompt waits for
    # room (4 sequences at most); the tiny model's tests check each way alone.
    spec_engine = free_verification(Engine(smollm2, replace(config, speculative="ngram", num_decode_steps=8),
                                           progress=False))
    spec = spec_engine.generate(prompts, params)
    for want, have in zip(plain, spec):
        assert (have[0].token_ids, have[0].finish_reason) == (want[0].token_ids, want[0].finish_reason)
        np.testing.assert_allclose([lp.logprob for lp in have[0].logprobs],
                                   [lp.logprob for lp in want[0].logprobs], atol=1e-4)
    assert "The river carried salt" in spec[-1][0].text  # it copies (the drafts come from the prompt)
    assert spec_engine.speculator.counters().num_accepted_tokens >= 10
