"""Overlapped scheduling on the tiny random model: the next step is dispatched before the host has the last
step's tokens, and yet tokens, text, logprobs, stops, limits and aborts are exactly those of collecting every
step first."""

import gc
import logging
import threading
from dataclasses import replace

import jax
import numpy as np
import pytest

from sluice.batching.engine import Engine
from sluice.batching.model_runner import PREFILL_PIECE, ModelRunner, token_buckets
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import SamplingParams
from test_engine import CONFIG, GREEDY, make_engine, page_bytes, prompts, tiny  # noqa: F401 - `tiny` is a fixture

KINDS = [
    GREEDY,
    replace(GREEDY, max_tokens=1),
    replace(GREEDY, max_tokens=5, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(200,)),
    replace(GREEDY, frequency_penalty=0.5),  # reads its history: steps with it are collected first
]


def fed_steps(engine) -> list[bool]:
    """Records, for each dispatched step, whether a token of it came from the step before on the device."""
    fed: list[bool] = []
    dispatch = engine.runner.dispatch

    def recording(chunks, *args, **kwargs):
        fed.append(any(chunk.seq.num_pending for chunk in chunks))
        return dispatch(chunks, *args, **kwargs)

    engine.runner.dispatch = recording
    return fed


def assert_same(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert a.usage == b.usage
    np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-5)


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_overlap_gives_the_tokens_text_and_logprobs_of_collecting_every_step_first(tiny, num_decode_steps):
    batch = prompts(12, seed=5)
    params = [KINDS[i % len(KINDS)] for i in range(len(batch))]
    overlapped = make_engine(tiny, num_decode_steps=num_decode_steps, warmup=False)
    serial = make_engine(tiny, num_decode_steps=num_decode_steps, async_scheduling=False, warmup=False)
    fed_overlapped, fed_serial = fed_steps(overlapped), fed_steps(serial)
    for a, b in zip(overlapped.generate(batch, params), serial.generate(batch, params)):
        assert_same(a[0], b[0])
    assert any(fed_overlapped) and not any(fed_serial)
    assert overlapped.stats.kv_pages_used == serial.stats.kv_pages_used == 0


def test_host_decided_sampler_branches_give_the_tokens_text_and_logprobs_of_device_decided_ones(tiny):
    """Multi-step calls of 4 decode steps, and single steps (prefills, and decodes while requests wait)."""
    batch = prompts(12, seed=6)
    params = [KINDS[i % len(KINDS)] for i in range(len(batch))]
    host = make_engine(tiny, num_decode_steps=4, sampler_branches="host")
    device = make_engine(tiny, num_decode_steps=4, sampler_branches="device", warmup=False)
    for a, b in zip(host.generate(batch, params), device.generate(batch, params)):
        assert_same(a[0], b[0])
    assert host.runner.plans_on_host and not device.runner.plans_on_host
    assert host.stats.kv_pages_used == 0


def test_a_plan_met_after_warm_up_compiles_off_the_engine_thread_and_its_steps_run_meanwhile(tiny):
    """Host plans: a request whose filters and logprobs no warmed plan covers runs single steps with the sampler of
    every pass while its own programs compile aside; nothing compiles on the engine thread, and the tokens are
    the device-decided engine's before and after."""
    before = set(threading.enumerate())
    host = make_engine(tiny, num_decode_steps=4, sampler_branches="host", enable_prefix_caching=False)
    device = make_engine(tiny, num_decode_steps=4, sampler_branches="device", warmup=False)
    compiled = host.runner.num_compiled()
    batch = prompts(6, seed=8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=12, logprobs=True,
                             top_logprobs=2, ignore_eos=True) for i in range(len(batch))]
    want = device.generate(batch, params)
    steps = host.stats.num_steps
    meanwhile = host.generate(batch, params)
    steps_meanwhile = host.stats.num_steps - steps
    host.runner.wait_for_compiles()
    steps = host.stats.num_steps
    compiled_aside = host.generate(batch, params)
    for a, b, c in zip(meanwhile, compiled_aside, want):
        assert_same(a[0], c[0])
        assert_same(b[0], c[0])
        np.testing.assert_allclose([lp.logprob for lp in a[0].logprobs], [lp.logprob for lp in c[0].logprobs],
                                   atol=1e-5)
    assert host.runner.num_compiled() == compiled
    assert host.runner.num_compiled_off_thread >= 2  # the decode call and a sampler, at least
    assert host.stats.num_steps - steps < steps_meanwhile  # decode calls of 4 steps, once compiled
    assert host.stats.kv_pages_used == 0
    (compiling,) = [thread for thread in set(threading.enumerate()) - before if thread.name == "sluice-compile"]
    del host, device
    gc.collect()
    compiling.join(timeout=30)
    assert not compiling.is_alive()  # a dropped engine's compile thread ends


def test_warm_up_compiles_the_plans_of_the_parameters_it_is_given(tiny):
    config = replace(CONFIG, kv_cache_memory=page_bytes(256), num_decode_steps=4, sampler_branches="host")
    both = Engine(tiny, config, progress=False)
    greedy = Engine(tiny, config, progress=False, warm_for=[GREEDY])
    compiled = greedy.runner.num_compiled()
    assert compiled < both.runner.num_compiled()  # no multi-step calls of sampling rows
    greedy.generate(prompts(6, seed=9), GREEDY)
    greedy.runner.wait_for_compiles()
    assert greedy.runner.num_compiled() == compiled and greedy.runner.num_compiled_off_thread == 0


def test_warm_up_compiles_the_plan_of_the_models_own_sampling_defaults(tiny):
    """Requests that leave their sampling fields out sample with the model's defaults (`generation_config`): a
    top_k filter here, a plan of its own, compiled at warm-up rather than while the first such request runs."""
    config = replace(CONFIG, kv_cache_memory=page_bytes(256), num_decode_steps=4, sampler_branches="host")
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    engine = Engine(replace(tiny, generation_defaults=defaults), config, progress=False)
    compiled = engine.runner.num_compiled()
    assert compiled > Engine(tiny, config, progress=False).runner.num_compiled()
    engine.generate(prompts(6, seed=9), SamplingParams(temperature=0.6, top_k=20, max_tokens=12, seed=3))
    engine.runner.wait_for_compiles()
    assert engine.runner.num_compiled() == compiled and engine.runner.num_compiled_off_thread == 0


def test_warm_up_compiles_each_model_program_once_off_the_engine_thread(tiny, caplog):
    config = replace(CONFIG, kv_cache_memory=page_bytes(256), num_decode_steps=4, sampler_branches="host")
    jax.config.update("jax_log_compiles", True)  # for every thread (`jax.log_compiles()` is the calling thread's)
    try:
        with caplog.at_level(logging.WARNING):
            runner = Engine(tiny, config, progress=False).runner
    finally:
        jax.config.update("jax_log_compiles", False)
    models = [r.threadName for r in caplog.records
              if r.getMessage().startswith(("Compiling jit(forward)", "Compiling jit(decode_steps)"))]
    # A single step's program per bucket, a multi-step call's per bucket and plan (greedy, sampling): each compiled
    # once, on a warm-up thread, and found in jit's cache when warm-up then runs it.
    assert len(models) == 3 * len(runner.decode_buckets) + len(runner.token_buckets)
    assert all(name.startswith("sluice-warmup") for name in models)


def test_mixed_steps_past_512_tokens_pad_by_under_a_quarter():
    buckets = token_buckets(PREFILL_PIECE, 8192)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 8192
    assert all(b % PREFILL_PIECE == 0 for b in buckets)
    for n in range(1, 8193):
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n < n / 4 if n > 512 else bucket < 2 * n or bucket == PREFILL_PIECE
    assert token_buckets(PREFILL_PIECE, 3000)[-3:] == [2048, 2560, 3000]
    assert token_buckets(PREFILL_PIECE, 512) == [16, 32, 64, 128, 256, 512]  # the CPU's: no more programs


def test_a_program_that_fails_to_compile_off_the_thread_compiles_at_its_warm_up_call(tiny, caplog, monkeypatch):
    lowering = ModelRunner._lowering

    def failing(runner, bucket, plan):
        if bucket.num_steps > 1 and bucket.num_rows == 2:
            def fail():
                raise RuntimeError("no compiler thread today")
            return fail
        return lowering(runner, bucket, plan)

    monkeypatch.setattr(ModelRunner, "_lowering", failing)
    with caplog.at_level(logging.WARNING):
        engine = make_engine(tiny, num_decode_steps=4)
    assert "compiling one at a time" in caplog.text and "no compiler thread today" in caplog.text
    batch = prompts(4, seed=3)
    assert [o[0].token_ids for o in engine.generate(batch, GREEDY)] == \
        [o[0].token_ids for o in make_engine(tiny, num_decode_steps=1, warmup=False).generate(batch, GREEDY)]


def test_a_stop_string_found_while_the_next_step_runs_emits_nothing_after_it(tiny):
    engine = make_engine(tiny, warmup=False)
    prompt = [31, 32, 33, 34, 35]
    free = engine.generate([prompt], GREEDY)[0][0]
    stop = free.text[len(free.text) // 3:len(free.text) // 3 + 2]
    generated = engine.stats.generation_tokens_total
    by_text = engine.generate([prompt], replace(GREEDY, stop=(stop,)))[0][0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[:free.text.index(stop)]
    assert by_text.token_ids == free.token_ids[:len(by_text.token_ids)]
    assert by_text.usage.completion_tokens == len(by_text.token_ids) < len(free.token_ids)
    assert engine.stats.generation_tokens_total - generated == len(by_text.token_ids)
    assert engine.stats.kv_pages_used == 0


def test_collecting_every_step_first_a_stop_string_ends_its_sequence_before_the_next_step(tiny):
    """Without overlap, the host knows a step's tokens before it schedules the next, so a stop string costs no
    step past the one that sampled it: one step a token, the prompt's included."""
    engine = make_engine(tiny, async_scheduling=False, warmup=False)
    prompt = [31, 32, 33, 34, 35]
    free = engine.generate([prompt], GREEDY)[0][0]
    stop = free.text[len(free.text) // 3:len(free.text) // 3 + 2]
    steps = engine.stats.num_steps
    by_text = engine.generate([prompt], replace(GREEDY, stop=(stop,)))[0][0]
    assert by_text.finish_reason == "stop" and len(by_text.token_ids) < len(free.token_ids)
    assert engine.stats.num_steps - steps == len(by_text.token_ids)


def test_a_sequence_whose_steps_are_collected_twice_in_one_step_emits_each_token_once_in_order(tiny):
    """A penalized neighbour turns overlap off from the second step: that step collects the first (a plain
    sequence's first token, appended one by one) and then itself (its second, appended and sent in one pass);
    the first must be sent before the second."""
    engine = make_engine(tiny, warmup=False)
    plain, penalized = prompts(2, seed=3)
    alone = engine.generate([plain], GREEDY)[0][0]
    both = engine.generate([plain, penalized], [GREEDY, replace(GREEDY, frequency_penalty=0.5)])
    assert both[0][0].token_ids == alone.token_ids and both[0][0].text == alone.text


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_is_exact_although_the_host_schedules_ahead(tiny, max_tokens):
    engine = make_engine(tiny, warmup=False)
    outs = engine.generate(prompts(5, seed=max_tokens), replace(GREEDY, max_tokens=max_tokens))
    for out in outs:
        assert len(out[0].token_ids) == out[0].usage.completion_tokens == max_tokens
        assert out[0].finish_reason == "length"
    assert engine.stats.kv_pages_used == 0 and engine.stats.num_seqs_running == 0


def test_an_abort_with_a_step_in_flight_keeps_only_tokens_already_sampled_and_frees_every_page(tiny):
    engine = make_engine(tiny, warmup=False)
    prompt = [41, 42, 43, 44]
    free = engine.generate([prompt], replace(GREEDY, max_tokens=30))[0][0]
    collector = ListCollector(1)
    engine.submit([prompt], replace(GREEDY, max_tokens=30), collector, "aborted")
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None  # the abort meets a dispatched step whose tokens the host lacks
    engine.abort("aborted")
    while engine.has_work:
        engine.step()
    out = collector.completions()[0]
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < 30 and out.token_ids == free.token_ids[:len(out.token_ids)]
    assert out.usage.completion_tokens == len(out.token_ids)
    assert engine.stats.kv_pages_used == 0
