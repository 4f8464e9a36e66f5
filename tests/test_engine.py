"""Engine on the tiny random model: preemption, aborts, seeds, n > 1, stop ids, rejection, failure isolation,
no recompilation."""

import asyncio
import random
import threading
from dataclasses import replace

import numpy as np
import pytest
from flax import nnx

from sluice.batching.config import ACCELERATOR_BATCH, ACCELERATOR_PAGE_SIZE, CPU_BATCH, CPU_PAGE_SIZE, \
    LARGE_ACCELERATOR_BATCH, EngineConfig, InvalidEngineConfig, default_batch
from sluice.batching.engine import Engine
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import RequestRejected
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.sequence import Sequence
from sluice.model.config import ModelConfig
from sluice.model.generate import generate
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from test_speculative import free_verification

PAGE = 4
CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=PAGE,
                      num_decode_steps=1)
TINY = ModelConfig.tiny()


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    """The tiny random model, with SmolLM2's tokenizer for detokenizing (ids < 256 are single byte tokens)."""
    return LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")


def page_bytes(num_pages: int) -> int:
    return num_pages * 2 * TINY.num_layers * TINY.num_kv_heads * PAGE * TINY.head_dim * 4


def make_engine(tiny: LoadedModel, num_pages: int = 256, **overrides) -> Engine:
    return Engine(tiny, replace(CONFIG, kv_cache_memory=page_bytes(num_pages), **overrides), progress=False)


@pytest.fixture(scope="module")
def engine(tiny) -> Engine:
    return make_engine(tiny)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_batch_limits_and_page_size_left_unset_are_the_devices_and_set_ones_are_kept(tiny):
    assert default_batch("cpu", None) == CPU_BATCH == (64, 512)
    assert default_batch("gpu", None) == default_batch("gpu", 18 << 30) == ACCELERATOR_BATCH == (256, 2048)
    h100 = 80 << 30
    assert default_batch("gpu", h100) == default_batch("tpu", 95 << 30) == LARGE_ACCELERATOR_BATCH == (1024, 8192)
    assert default_batch("gpu", h100, "NVIDIA A100-SXM4-80GB") == ACCELERATOR_BATCH  # vLLM's exception
    assert default_batch("gpu", 48 << 30) == ACCELERATOR_BATCH  # an L40S
    unset = Engine(tiny, replace(CONFIG, max_num_seqs=None, max_num_batched_tokens=None, page_size=None,
                                 warmup=False), progress=False)
    assert (unset.config.max_num_seqs, unset.config.max_num_batched_tokens) == CPU_BATCH
    assert unset.scheduler.config.max_num_seqs == unset.runner.max_num_seqs == 64
    assert unset.config.page_size == unset.runner.page_size == unset.block_manager.page_size == CPU_PAGE_SIZE == 64
    kept = EngineConfig(max_num_seqs=8, page_size=32).with_device_defaults("gpu", h100)
    assert (kept.max_num_seqs, kept.max_num_batched_tokens, kept.page_size) == (8, 8192, 32)
    assert EngineConfig().with_device_defaults("gpu", h100).page_size == ACCELERATOR_PAGE_SIZE == 16


def test_a_steps_token_budget_is_never_below_its_sequences():
    """A decode step holds a token of each running sequence: a budget below the batch is refused when both are
    given, and a limit left unset yields to the one given."""
    with pytest.raises(InvalidEngineConfig, match=r"tokens must be at least the sequences a step may run \(64\)"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert EngineConfig(max_num_batched_tokens=32).with_device_defaults("cpu", None).max_num_seqs == 32
    assert EngineConfig(max_num_seqs=1024).with_device_defaults("cpu", None).max_num_batched_tokens == 1024


def test_small_pool_preempts_yet_every_request_gets_its_greedy_tokens_and_no_page_is_left(tiny):
    engine = make_engine(tiny, num_pages=32, warmup=False)  # the context (128 tokens), not 8 requests at once
    batch = prompts(8, seed=1)
    outs = engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert engine.stats.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert list(out[0].token_ids) == generate(tiny.model, prompt, 30)
    assert engine.stats.kv_pages_used == 0


async def settled(engine: Engine, timeout_s: float = 10.0):
    """The stats snapshot once the engine holds no request and no page (they are published after each step)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = engine.stats
        idle = stats.kv_pages_used == 0 and stats.num_requests_running == 0 and stats.num_requests_waiting == 0
        if idle or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_engine_requests_complete_with_usage_and_logprobs(engine):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3)

    async def run():
        await engine.start()
        try:
            return [out async for out in engine.add_request([[5, 6, 7, 8]], params, request_id="usage")]
        finally:
            await engine.shutdown()

    outs = asyncio.run(run())
    assert sum(len(o.token_ids) for o in outs) == 5
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].usage.prompt_tokens == 4 and outs[-1].usage.completion_tokens == 5
    for o in outs:  # increments the consumer had not taken yet arrive joined (Collector), one logprob per token
        assert [lp.token_id for lp in o.logprobs] == list(o.token_ids)
        for lp in o.logprobs:
            assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the best


def test_shutdown_returns_once_the_engine_and_its_watchdog_threads_are_gone(engine):
    """A watchdog left running holds the engine: at interpreter exit it would free jax arrays and abort."""

    def threads() -> set[str]:  # the step loop's threads (an off-thread compiler, if any, outlives it)
        return {t.name for t in threading.enumerate()} & {"sluice-engine", "sluice-watchdog"}

    async def run():
        await engine.start()
        running = threads()
        await engine.shutdown()
        return running, threads()

    assert engine.config.step_timeout_s is not None
    assert asyncio.run(run()) == ({"sluice-engine", "sluice-watchdog"}, set())


def test_one_request_fans_out_over_prompts_and_samples_with_usage_counting_each_prompt_once(tiny, engine):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    first, second = [5, 6, 7, 8, 9], [40, 41, 42]

    async def run():
        await engine.start()
        try:
            collector = engine.add_request([first, second], params)
            return [out async for out in collector], collector.usage
        finally:
            await engine.shutdown()

    outs, usage = asyncio.run(run())
    by_choice = {c: tuple(t for o in outs if o.choice == c for t in o.token_ids) for c in range(4)}
    alone = [generate(tiny.model, p, 4) for p in (first, second)]
    assert [list(by_choice[c]) for c in range(4)] == [alone[0], alone[0], alone[1], alone[1]]
    assert outs[-1].usage == usage and (usage.prompt_tokens, usage.completion_tokens) == (8, 16)


def test_abort_mid_generation_ends_the_request_and_frees_its_pages_by_the_next_step(engine):
    async def run():
        await engine.start()
        try:
            stream = aiter(engine.add_request([list(range(10, 50))], SamplingParams(max_tokens=80, ignore_eos=True),
                                              request_id="to-abort"))
            first = await anext(stream)
            assert engine.stats.kv_pages_used > 0
            engine.abort("to-abort")
            rest = [o async for o in stream]
            return first, rest, await settled(engine)
        finally:
            await engine.shutdown()

    first, rest, stats = asyncio.run(run())
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"
    assert stats.kv_pages_used == 0


def test_abort_all_also_aborts_a_request_submitted_after_it(tiny):
    """A drain that ran out of time aborts everything: a request still being built then (its grammar compiled in
    its submission's thread) is aborted when it arrives, not left to run until the server is stopped."""
    engine = make_engine(tiny, warmup=False)  # its own: after abort_all it serves nothing

    async def run():
        await engine.start()
        try:
            engine.abort_all()
            while not engine._inbox.empty():  # taken while idle, as the drain's is
                await asyncio.sleep(0.01)
            late = [o async for o in engine.add_request([list(range(10, 30))],
                                                        SamplingParams(max_tokens=40, ignore_eos=True))]
            return late, await settled(engine)
        finally:
            await engine.shutdown()

    late, stats = asyncio.run(asyncio.wait_for(run(), 30))
    assert late[-1].finish_reason == "abort" and sum(len(o.token_ids) for o in late) == 0
    assert stats.kv_pages_used == 0


def test_an_engine_whose_loop_ended_after_abort_all_serves_again(tiny):
    """abort_all is for the step loop it was sent to (a drain, then the loop's end): a loop started again (as this
    module's tests start its engine, each its own) and offline `generate` serve their requests."""
    engine = make_engine(tiny, warmup=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run():
        await engine.start()
        engine.abort_all()
        await engine.shutdown()
        await engine.start()
        try:
            return [o async for o in engine.add_request([[5, 6, 7]], params)]
        finally:
            await engine.shutdown()

    outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 4
    [[offline]] = engine.generate([[5, 6, 7]], params)
    assert offline.finish_reason == "length" and len(offline.token_ids) == 4


def test_hundred_random_aborts_leak_no_pages(engine):
    rng = random.Random(3)

    async def one(i: int):
        collector = engine.add_request([prompts(1, seed=100 + i)[0]], SamplingParams(max_tokens=40, ignore_eos=True))
        stop_after = rng.randrange(0, 6)
        seen = 0
        async for _ in collector:
            seen += 1
            if seen > stop_after:
                break
        if not collector.finished:
            engine.abort(collector.request_id)

    async def run():
        await engine.start()
        try:
            for wave in range(10):
                await asyncio.gather(*(one(wave * 10 + j) for j in range(10)))
            return await settled(engine)
        finally:
            await engine.shutdown()

    stats = asyncio.run(run())
    assert stats.kv_pages_used == 0 and stats.num_requests_running == 0 and stats.num_requests_waiting == 0


def test_seeded_request_samples_the_same_tokens_in_different_batches(engine):
    target = [9, 8, 7, 6, 5, 4, 3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = engine.generate([target], seeded)[0][0].token_ids
    crowd = prompts(6, seed=5)
    others = [SamplingParams(temperature=0.7, top_k=20, max_tokens=rng, ignore_eos=True) for rng in range(3, 9)]
    mixed = engine.generate(crowd[:3] + [target] + crowd[3:], others[:3] + [seeded] + others[3:])
    assert mixed[3][0].token_ids == alone


def running(engine: Engine, request_id: str) -> list[Sequence]:
    return sorted((s for s in engine.scheduler.running if s.request_id == request_id), key=lambda s: s.choice)


def test_n_sequences_share_the_prompt_pages_and_sample_independently(engine):
    prompt = list(range(20, 60))  # 10 full pages
    collector = ListCollector(4)
    engine.submit([prompt], SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=7, ignore_eos=True), collector,
                  "shared")
    engine.step()
    first = running(engine, "shared")[0]
    while first.num_computed_tokens < len(prompt):
        engine.step()
    engine.step()  # siblings join, sharing the prompt's full pages
    siblings = running(engine, "shared")
    assert len(siblings) == 4 and all(s.page_table[:9] == first.page_table[:9] for s in siblings)
    assert engine.block_manager.ref_counts[first.page_table[0]] == 4
    while engine.has_work:
        engine.step()
    outputs = [c.token_ids for c in collector.completions()]
    assert all(len(o) == 6 for o in outputs) and len(set(outputs)) > 1
    assert engine.block_manager.num_used_pages == 0


def test_n_sequences_with_a_seed_are_reproducible(engine):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11, ignore_eos=True)
    first = [o.token_ids for o in engine.generate([[4, 5, 6, 7, 8]], params)[0]]
    again = [o.token_ids for o in engine.generate([[4, 5, 6, 7, 8]], params)[0]]
    assert first == again and len(first) == 3


def test_a_seeded_prompt_of_a_list_samples_as_it_does_alone_and_unseeded_choices_draw_apart(engine):
    """A completions request's list of prompts: seeded, each prompt's samples are those it gets in a request of its
    own, wherever it is in the list (vLLM runs each as a request); unseeded, even the same prompt twice draws apart."""
    target = [4, 5, 6, 7, 8]
    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=11, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate([target], seeded)[0]]
    collector = ListCollector(6)
    engine.submit([[30, 31, 32], target, target], seeded, collector, "seeded-list")
    while engine.has_work:
        engine.step()
    listed = [o.token_ids for o in collector.completions()]
    assert listed[2:4] == alone and listed[4:6] == alone and listed[0:2] != alone
    unseeded = replace(seeded, seed=None, n=1)
    collector = ListCollector(2)
    engine.submit([target, target], unseeded, collector, "unseeded-list")
    while engine.has_work:
        engine.step()
    first, second = (o.token_ids for o in collector.completions())
    assert first != second


def test_stop_token_id_ends_the_sequence_but_not_before_min_tokens(engine):
    prompt = [11, 12, 13, 14]
    free = engine.generate([prompt], GREEDY)[0][0].token_ids
    stop_id = free[3]
    first_at = free.index(stop_id)
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,)))
    assert stopped[0][0].token_ids == free[:first_at + 1] and stopped[0][0].finish_reason == "stop"
    held = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first_at + 2,
                                                    stop_token_ids=(stop_id,)))
    assert stop_id not in held[0][0].token_ids[:first_at + 2]


@pytest.mark.parametrize("stop", [(), ("never",)])
def test_a_completion_cut_mid_character_reads_as_the_tokenizer_decodes_its_tokens(tiny, engine, stop):
    """max_tokens cutting a character whose bytes span several tokens: those bytes end the text as U+FFFD."""
    completions = [out[0] for out in engine.generate(prompts(8), replace(GREEDY, max_tokens=3, stop=stop))]
    decoded = [tiny.tokenizer.decode(c.token_ids) for c in completions]
    assert any(text.endswith("\ufffd") for text in decoded), "some completion should end mid-character"
    assert [c.text for c in completions] == decoded


def test_by_default_the_context_is_no_longer_than_the_pool_holds(tiny):
    small = make_engine(tiny, num_pages=8, warmup=False, max_model_len=None)
    assert small.max_model_len == 8 * PAGE
    prompt = [5] * 10  # and a reply that fills the rest of the context, as a chat without max_tokens asks
    [[done]] = small.generate([prompt], SamplingParams(max_tokens=small.max_model_len - len(prompt), temperature=0,
                                                       ignore_eos=True))
    assert len(done.token_ids) == small.max_model_len - len(prompt) and done.finish_reason == "length"


def test_a_pool_smaller_than_one_page_is_refused_not_rounded_up(tiny):
    with pytest.raises(ValueError, match=f"holds no page: one page of {PAGE} tokens takes {page_bytes(1):,} bytes"):
        Engine(tiny, replace(CONFIG, kv_cache_memory=page_bytes(1) - 1), progress=False)


def test_requests_that_can_never_fit_are_rejected_up_front(tiny, engine):
    with pytest.raises(RequestRejected, match="context length is 128 tokens; the prompt has 100 tokens and 29 more"):
        engine.generate([[5] * 100], SamplingParams(max_tokens=29))
    with pytest.raises(RequestRejected, match="the prompt is too long: 128 tokens$"):  # no reply length to speak of
        engine.generate([[5] * 128], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="empty"):
        engine.generate([[]], GREEDY)
    # A tokenizer with more tokens than the model's embeddings (one copied from another model) gives such ids.
    with pytest.raises(RequestRejected, match=f"token id {TINY.vocab_size} is outside the model's vocabulary of "
                                              f"{TINY.vocab_size} tokens"):
        engine.generate([[5, TINY.vocab_size, 6]], GREEDY)
    with pytest.raises(RequestRejected, match="min_tokens"):
        engine.generate([[5]], SamplingParams(max_tokens=4, min_tokens=5))
    with pytest.raises(RequestRejected, match="min_tokens needs an allowed token id that is not a stop id"):
        engine.generate([[5]], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(7,), allowed_token_ids=(7,)))


def test_a_failure_in_one_requests_host_work_ends_only_that_request(engine):
    good, bad = [30, 31, 32, 33], [50, 51, 52]
    alone = engine.generate([good], GREEDY)[0][0].token_ids
    good_out, bad_out = ListCollector(1), ListCollector(1)
    engine.submit([good], GREEDY, good_out, "good")
    engine.submit([bad], GREEDY, bad_out, "bad")
    engine.step()
    (broken,) = running(engine, "bad")

    def detokenizer_bug(*args):
        raise UnicodeError("cannot decode")

    broken.stop.emit_run = detokenizer_bug
    while engine.has_work:
        engine.step()
    (failed,) = bad_out.completions()
    assert failed.finish_reason == "error" and "cannot decode" in failed.error
    assert good_out.completions()[0].token_ids == alone
    assert engine.stats.kv_pages_used == 0


def test_a_failed_device_step_ends_its_requests_and_the_engine_serves_the_next(tiny, engine, monkeypatch):
    first = ListCollector(1)
    engine.submit([[60, 61, 62]], GREEDY, first, "in-failed-step")
    real_dispatch = engine.runner.dispatch

    def failing_dispatch(*args):
        monkeypatch.setattr(engine.runner, "dispatch", real_dispatch)
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.runner, "dispatch", failing_dispatch)
    while engine.has_work:
        engine.step()
    (failed,) = first.completions()
    assert failed.finish_reason == "error" and "device fault" in failed.error
    assert engine.stats.kv_pages_used == 0
    assert list(engine.generate([[60, 61, 62]], GREEDY)[0][0].token_ids) == generate(tiny.model, [60, 61, 62], 12)


MULTI_STEP_KINDS = [
    GREEDY,
    SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=11, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=7, presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.3,
                   seed=6, max_tokens=13, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2),
]


def test_multi_step_decode_gives_the_tokens_and_logprobs_of_single_steps(tiny, engine):
    batch = prompts(8, seed=21)
    params = [MULTI_STEP_KINDS[i % len(MULTI_STEP_KINDS)] for i in range(8)]
    multi = make_engine(tiny, num_decode_steps=4, warmup=False)
    single_outs, multi_outs = engine.generate(batch, params), multi.generate(batch, params)
    for single, many in zip(single_outs, multi_outs):
        assert many[0].token_ids == single[0].token_ids and many[0].finish_reason == single[0].finish_reason
        np.testing.assert_allclose([lp.logprob for lp in many[0].logprobs],
                                   [lp.logprob for lp in single[0].logprobs], atol=1e-5)
    assert multi.stats.kv_pages_used == 0 and multi.stats.num_steps < engine.stats.num_steps


def test_layers_unrolled_over_one_array_each_give_the_scans_tokens_and_logprobs(tiny, engine):
    batch = prompts(8, seed=23)
    params = [MULTI_STEP_KINDS[i % len(MULTI_STEP_KINDS)] for i in range(8)]
    own = LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), tiny.tokenizer, "tiny")  # the runner unstacks it
    unrolled = make_engine(own, num_decode_steps=4, layer_loop="unrolled", warmup=False)
    assert own.model.layers_unstacked and not tiny.model.layers_unstacked
    for scanned, unstacked in zip(engine.generate(batch, params), unrolled.generate(batch, params)):
        assert unstacked[0].token_ids == scanned[0].token_ids
        np.testing.assert_allclose([lp.logprob for lp in unstacked[0].logprobs],
                                   [lp.logprob for lp in scanned[0].logprobs], atol=1e-5)


def test_multi_step_decode_stops_on_a_stop_id_or_string_inside_a_call_and_keeps_nothing_after(tiny, engine):
    multi = make_engine(tiny, num_decode_steps=8, warmup=False)
    prompt = [11, 12, 13, 14]
    free = engine.generate([prompt], GREEDY)[0][0]
    by_id = multi.generate([prompt], replace(GREEDY, stop_token_ids=(free.token_ids[4],)))[0][0]
    first = free.token_ids.index(free.token_ids[4])
    assert by_id.token_ids == free.token_ids[:first + 1] and by_id.finish_reason == "stop"
    streamed = free.text.rstrip("\ufffd")  # a character cut at the end comes out, as U+FFFD, only at the finish
    stop = streamed[len(streamed) // 2:len(streamed) // 2 + 2]
    by_text = multi.generate([prompt], replace(GREEDY, stop=(stop,)))[0][0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[:free.text.index(stop)]
    assert by_text.usage.completion_tokens == len(by_text.token_ids) < len(free.token_ids)
    assert multi.stats.kv_pages_used == 0


def nan_token_model(token: int) -> Llama:
    """The tiny model with token `token`'s embedding NaN: every position from it on computes NaN."""
    model = Llama(TINY, rngs=nnx.Rngs(0))
    model.embed[...] = model.embed[...].at[token].set(np.nan)
    return model


@pytest.mark.parametrize("pooling", [None, "mean"], ids=["prompt-logprobs", "embedding"])
def test_prompt_scores_or_an_embedding_not_finite_end_their_request_alone(tiny, pooling):
    """A prompt whose first chunk (of two: 8 tokens a step) computes NaN: its prompt logprobs, or its embedding, are
    not finite, and its request ends with an error there (it sent NaN logprobs, or a NaN embedding, before), while
    a request beside it is served."""
    nan_engine = make_engine(replace(tiny, model=nan_token_model(7)), max_num_batched_tokens=8, warmup=False)
    params = (SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling) if pooling
              else replace(GREEDY, prompt_logprobs=1, max_tokens=2))
    poisoned, fine = ListCollector(1), ListCollector(1)
    nan_engine.submit([[30, 7, 31, 32, 33, 34, 35, 36, 37, 38, 39]], params, poisoned, "poisoned")
    nan_engine.submit([[40, 41, 42]], replace(GREEDY, max_tokens=2), fine, "fine")
    while nan_engine.has_work:
        nan_engine.step()
    [failed], [served] = poisoned.completions(), fine.completions()
    what = "hidden states" if pooling else "prompt logprobs"
    assert failed.finish_reason == "error" and f"model's {what} for this sequence were not finite" in failed.error
    assert served.finish_reason == "length" and len(served.token_ids) == 2
    assert nan_engine.stats.kv_pages_used == 0


# The drafting engine warms up: the one test whose warm-up runs the verify and speculative buckets (all padding).
@pytest.mark.parametrize("settings", [dict(num_decode_steps=4, warmup=False),
                                      dict(num_decode_steps=4, speculative="ngram", warmup=True)],
                         ids=["multi-step", "drafts-in-multi-step-calls"])
def test_logits_not_finite_inside_a_multi_step_call_end_the_request_as_in_single_steps(tiny, engine, settings):
    """Token g[1]'s embedding is NaN: the step that computes it (the second of a multi-step call) has logits that
    are not finite. Its request ends with an error, as with single steps, not with that step's arbitrary tokens."""
    prompt = [31, 32, 33, 34, 35]
    free = engine.generate([prompt], GREEDY)[0][0].token_ids
    multi = make_engine(replace(tiny, model=nan_token_model(free[1])), **settings)
    if multi.speculator is not None:
        free_verification(multi)  # every call checks drafts (`verify_steps`)
    [[out]] = multi.generate([prompt], replace(GREEDY, max_tokens=4))
    assert out.finish_reason == "error" and "not finite" in out.error
    assert out.token_ids == free[:len(out.token_ids)]
    assert multi.stats.kv_pages_used == 0


def test_steady_state_never_recompiles(engine):
    compiled = engine.runner.num_compiled()
    row_counts = {b.num_rows for b in engine.runner.buckets if b.num_steps == 1}
    # A sampler and a mask per row count, and a slot write per count of rows written.
    assert compiled == len(engine.runner.buckets) + 2 * len(row_counts) + len(engine.runner.input_batch.buckets)
    rng = random.Random(9)
    steps = 0
    kinds = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=1, ignore_eos=True, max_tokens=9),
             SamplingParams(temperature=1.0, top_k=5, min_p=0.1, presence_penalty=0.5, repetition_penalty=1.2,
                            max_tokens=7, ignore_eos=True)]
    while steps < 50:
        if rng.random() < 0.3:
            engine.submit([prompts(1, seed=steps)[0]], rng.choice(kinds), ListCollector(1), f"steady-{steps}")
        if engine.has_work:
            engine.step()
            steps += 1
    while engine.has_work:
        engine.step()
    assert engine.runner.num_compiled() == compiled
    # Prompt logprobs: the scoring program runs after the warmed step, which compiles no model of its own.
    scored, = engine.generate([prompts(1, seed=50)[0]], replace(GREEDY, prompt_logprobs=1))
    assert len(scored[0].prompt_logprobs) > 1 and engine.runner.num_compiled() == compiled


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_a_page_ending_in_a_stop_id_is_not_cached_before_its_kv_is_written(tiny, num_decode_steps):
    """A multi-step call stops a row at its stop id without feeding it: the page whose last slot that id fills
    has no K/V there, so the next turn (prompt, reply, more) must not take that page from the prefix cache."""
    prompt = [33, 44]  # with the reply's first two tokens, one page of PAGE = 4
    free = make_engine(tiny, enable_prefix_caching=False, warmup=False)
    stop_id = free.generate([prompt], replace(GREEDY, max_tokens=24))[0][0].token_ids[1]
    engine = make_engine(tiny, num_decode_steps=num_decode_steps, warmup=False)
    first = engine.generate([prompt], replace(GREEDY, max_tokens=24, stop_token_ids=(stop_id,)))[0][0]
    assert first.finish_reason == "stop" and len(prompt) + len(first.token_ids) == PAGE
    next_turn = [*prompt, *first.token_ids, 60, 61]
    hits = engine.stats.prefix_cache_hit_tokens
    assert (engine.generate([next_turn], replace(GREEDY, max_tokens=8))[0][0].token_ids
            == free.generate([next_turn], replace(GREEDY, max_tokens=8))[0][0].token_ids)
    # Overlapped single steps: the step after the stop id's was dispatched before the host saw it, and fed it.
    assert engine.stats.prefix_cache_hit_tokens - hits == (PAGE if num_decode_steps == 1 else 0)


@pytest.mark.parametrize("num_decode_steps", [1, 3, 4])
def test_next_turns_read_from_the_prefix_cache_answer_as_computed_afresh(tiny, num_decode_steps):
    """A differential check of the cache's pages against their K/V: replies of random lengths (a stop id at a
    random place, batched or alone), each followed by a next turn (prompt, reply, one more token); the engine with
    the prefix cache answers every next turn as one without it. Pages of 4 tokens: many replies end on a page's
    last slot, in every place of a multi-step call."""
    free = make_engine(tiny, enable_prefix_caching=False, warmup=False)
    engine = make_engine(tiny, num_decode_steps=num_decode_steps, warmup=False)
    rng = random.Random(num_decode_steps)
    hits = engine.stats.prefix_cache_hit_tokens
    for case in range(30):
        batch = prompts(rng.randrange(1, 5), seed=100 + case)
        replies = [out[0].token_ids for out in free.generate(batch, replace(GREEDY, max_tokens=20))]
        stops = [replace(GREEDY, max_tokens=20, stop_token_ids=(rng.choice(reply),)) for reply in replies]
        if case % 2:
            firsts = [engine.generate([p], params)[0][0] for p, params in zip(batch, stops)]
        else:
            firsts = [out[0] for out in engine.generate(batch, stops)]
        turns = [[*p, *first.token_ids, rng.randrange(3, 256)] for p, first in zip(batch, firsts)]
        params = replace(GREEDY, max_tokens=6)
        assert ([out[0].token_ids for out in engine.generate(turns, params)]
                == [out[0].token_ids for out in free.generate(turns, params)]), case
    assert engine.stats.prefix_cache_hit_tokens - hits > 0


def test_a_prompt_scored_a_token_a_step_beside_a_decoding_neighbour_gets_the_logprobs_of_one_chunk(tiny, engine):
    """A token budget of 2 leaves a scoring prompt one token a step beside a decoding sequence: a step of one-token
    chunks that scores (it once ran decode-shaped, without the hidden states scoring reads, and failed the step
    and its neighbour)."""
    scored_params = replace(GREEDY, max_tokens=3, prompt_logprobs=1)
    prompt, neighbour = [10, 20, 30, 40, 50], [1, 2, 3]
    whole = engine.generate([prompt], scored_params)[0][0]
    narrow = make_engine(tiny, max_num_seqs=2, max_num_batched_tokens=2, warmup=False)
    beside, alone = narrow.generate([neighbour, prompt], [replace(GREEDY, max_tokens=20), scored_params])
    assert beside[0].finish_reason == alone[0].finish_reason == "length" and narrow.stats.num_step_failures == 0
    assert alone[0].token_ids == whole.token_ids
    assert whole.prompt_logprobs[0] is None and alone[0].prompt_logprobs[0] is None
    np.testing.assert_allclose([lp.logprob for lp in alone[0].prompt_logprobs[1:]],
                               [lp.logprob for lp in whole.prompt_logprobs[1:]], atol=1e-5)
