"""Engine on the tiny random model: preemption, aborts, seeds, n > 1, stop ids, rejection, no recompilation."""

import asyncio
import random
from dataclasses import replace

import pytest
from flax import nnx

from batching.config import EngineConfig
from batching.engine import Engine, RequestRejected
from batching.sampling_params import SamplingParams
from model.config import ModelConfig
from model.generate import generate
from model.llama import Llama
from model.loader import LoadedModel, load_model

PAGE = 4
CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=PAGE)
TINY = ModelConfig.tiny()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    """The tiny random model, with SmolLM2's tokenizer for detokenizing (ids < 256 are single byte tokens)."""
    tokenizer = load_model().tokenizer
    return LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), tokenizer, "tiny")


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


def test_small_pool_preempts_yet_every_request_gets_its_greedy_tokens_and_no_page_is_left(tiny):
    engine = make_engine(tiny, num_pages=24)
    batch = prompts(8, seed=1)
    outs = engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert list(out[0].token_ids) == generate(tiny.model, prompt, 30)
    assert engine.stats().kv_pages_used == 0


def test_engine_requests_complete_with_usage_and_logprobs(engine):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3)

    async def run():
        await engine.start()
        try:
            return [out async for out in engine.add_request([5, 6, 7, 8], params, request_id="usage")]
        finally:
            await engine.shutdown()

    outs = asyncio.run(run())
    assert sum(len(o.token_ids) for o in outs) == 5
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].usage.prompt_tokens == 4 and outs[-1].usage.completion_tokens == 5
    for o in outs:
        (lp,) = o.logprobs
        assert lp.token_id == o.token_ids[0] and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the best


def test_abort_mid_generation_frees_the_request_pages_at_once(engine):
    async def run():
        await engine.start()
        try:
            stream = engine.add_request(list(range(10, 50)), SamplingParams(max_tokens=80, ignore_eos=True),
                                        request_id="to-abort")
            first = await anext(stream)
            assert engine.stats().kv_pages_used > 0
            engine.abort("to-abort")
            assert engine.stats().kv_pages_used == 0
            rest = [o async for o in stream]
            return first, rest
        finally:
            await engine.shutdown()

    first, rest = asyncio.run(run())
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"


def test_hundred_random_aborts_leak_no_pages(engine):
    rng = random.Random(3)

    async def one(i: int):
        stream = engine.add_request(prompts(1, seed=100 + i)[0], SamplingParams(max_tokens=40, ignore_eos=True),
                                    request_id=f"leak-{i}")
        stop_after = rng.randrange(0, 6)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen > stop_after:
                break
        await stream.aclose()  # closing early aborts

    async def run():
        await engine.start()
        try:
            for wave in range(10):
                await asyncio.gather(*(one(wave * 10 + j) for j in range(10)))
            await asyncio.sleep(0.05)
            return engine.stats()
        finally:
            await engine.shutdown()

    stats = asyncio.run(run())
    assert stats.kv_pages_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.core.requests


def test_seeded_request_samples_the_same_tokens_in_different_batches(engine):
    target = [9, 8, 7, 6, 5, 4, 3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = engine.generate([target], seeded)[0][0].token_ids
    crowd = prompts(6, seed=5)
    others = [SamplingParams(temperature=0.7, top_k=20, max_tokens=rng, ignore_eos=True) for rng in range(3, 9)]
    mixed = engine.generate(crowd[:3] + [target] + crowd[3:], others[:3] + [seeded] + others[3:])
    assert mixed[3][0].token_ids == alone


def test_n_sequences_share_the_prompt_pages_and_sample_independently(engine):
    prompt = list(range(20, 60))  # 10 full pages
    params = SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=7, ignore_eos=True)
    core = engine.core
    outputs = []
    core.add("shared", prompt, params, seed=7, sink=outputs.append)
    first = core.requests["shared"].seqs[0]
    while first.num_computed_tokens < len(prompt):
        core.step()
    core.step()  # siblings join, sharing the prompt's full pages
    siblings = core.requests["shared"].seqs
    assert all(s.page_table[:9] == first.page_table[:9] for s in siblings)
    assert core.block_manager.ref_counts[first.page_table[0]] == 4
    while core.has_work:
        core.step()
    by_index = {i: tuple(t for o in outputs if o.index == i for t in o.token_ids) for i in range(4)}
    assert all(len(v) == 6 for v in by_index.values())
    assert len(set(by_index.values())) > 1
    assert core.block_manager.num_used_pages == 0


def test_n_sequences_with_a_seed_are_reproducible(engine):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11, ignore_eos=True)
    first = [o.token_ids for o in engine.generate([[4, 5, 6, 7, 8]], params)[0]]
    again = [o.token_ids for o in engine.generate([[4, 5, 6, 7, 8]], params)[0]]
    assert first == again and len(first) == 3


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


def test_requests_that_can_never_fit_are_rejected_up_front(tiny, engine):
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.generate([[5] * 100], SamplingParams(max_tokens=29))
    small = make_engine(tiny, num_pages=8, warmup=False)
    with pytest.raises(RequestRejected, match="KV pages"):
        small.generate([[5] * 30], SamplingParams(max_tokens=3))
    with pytest.raises(RequestRejected, match="empty"):
        engine.generate([[]], GREEDY)


def test_steady_state_never_recompiles(engine):
    compiled = engine.runner.num_compiled()
    assert compiled == len(engine.runner.buckets)
    rng = random.Random(9)
    core = engine.core
    steps = 0
    kinds = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=1, ignore_eos=True, max_tokens=9),
             SamplingParams(temperature=1.0, top_k=5, min_p=0.1, presence_penalty=0.5, repetition_penalty=1.2,
                            max_tokens=7, ignore_eos=True)]
    while steps < 50:
        if rng.random() < 0.3:
            core.add(f"steady-{steps}", prompts(1, seed=steps)[0], rng.choice(kinds), seed=steps,
                     sink=lambda out: None)
        if core.has_work:
            core.step()
            steps += 1
        elif rng.random() < 0.5:
            continue
    while core.has_work:
        core.step()
    assert engine.runner.num_compiled() == compiled
