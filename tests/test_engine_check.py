"""bench.engine_check's pieces that the GPU run relies on and a CPU can check exactly."""

import json
import logging

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from sluice.batching import step_output
from sluice.batching.config import EngineConfig
from sluice.bench import device_profile, engine_check
from sluice.bench.dataset import BenchRequest
from sluice.model.llama import Llama
from sluice.model.roofline import Peaks, param_bytes
from sluice.model.tokenizer import ByteDetokenizer
from sluice.pallas_kernels.kv_cache import kv_cache_dtype


@pytest.mark.parametrize("name, params", [
    # Parameter counts the models' publishers state (config.json shapes, embeddings tied for the first two).
    ("smollm2-135m", 134_515_008),
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3-8b", 8_030_261_248),
])
def test_model_shapes_have_the_published_parameter_counts(name, params):
    config = engine_check.MODELS[name]
    abstract = nnx.eval_shape(lambda: Llama(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) == params


def test_file_free_tokenizer_covers_the_vocabulary():
    config = engine_check.MODELS["llama-3-8b"]
    tokenizer = engine_check.file_free_tokenizer(config)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == (128001,)
    assert sorted(b"".join(tokenizer.token_bytes(i) for i in range(256))) == list(range(256))
    # Token 256 spells 94 in base 94 with the printable characters from "!", 128255 spells 128093.
    assert tokenizer.decode([256, 128255]) == '"!' + "/Ob"
    assert isinstance(tokenizer.decode_stream(), ByteDetokenizer)


def test_kv_pool_holds_the_largest_wave_whole():
    config, sizes = engine_check.MODELS["tiny"], engine_check.Sizes.small()
    workload = [BenchRequest(tuple(range(100, 100 + p)), o) for p, o in [(10, 3), (40, 16), (5, 2), (30, 9)]]
    per_token = engine_check.kv_bytes_per_token(config, kv_cache_dtype("auto", "bfloat16"))  # the engine's pool
    # The wave of all four at concurrency 4: prompts + max(output, the timed wave's tokens) + a page each; the timed
    # wave's: its tokens, a multi-step call's, and one per step its 85 prompt tokens may take, 16 a step, and one.
    timed = sizes.tpot_steps + 1 + EngineConfig.num_decode_steps + 6 + 1
    tokens = sum(p + max(o, timed) + 16 for p, o in [(10, 3), (40, 16), (5, 2), (30, 9)])
    assert engine_check.kv_pool_bytes(config, workload, [], sizes, 16) == int(1.25 * tokens * per_token)
    assert [len(w) for w in engine_check.waves(workload, 1)] == [1, 1, 1, 1]


def test_decode_tpot_counts_each_requests_tokens_after_every_request_decodes():
    """Three requests: one's first token at 0 s, then one token per 10 ms (it decodes through the others'
    prefill); the others' first tokens at 50 ms, then bursts of 4 tokens (a multi-step call) every 40 ms. Each
    request's next 8 tokens after 50 ms (the last first token) have arrived by 130 ms: 24 tokens, 3 requests x
    80 ms / 24 = 10 ms per token. Counting to the early request's own 9th token would close the window at 80 ms,
    with none of the others' tokens in it. The tokens at 50 ms count as before the window."""
    early = [0.010 * i for i in range(31)]  # 0 .. 300 ms
    bursty = [0.050] + [0.050 + 0.040 * (1 + i // 4) for i in range(16)]  # bursts at 90, 130, 170, 210 ms
    assert engine_check.steady_decode_s([early, bursty, list(bursty)], tokens=9) == pytest.approx(0.010)
    with pytest.raises(AssertionError, match="ended before"):
        engine_check.steady_decode_s([early[:12], bursty, list(bursty)], tokens=9)


def test_decode_tpot_leaves_out_the_calls_that_end_requests():
    """Two requests decoding in calls of 4 tokens every 40 ms (10 ms per token), from a first token at 0 ms. A
    call that ends a request after 1 of its 4 steps still takes 40 ms: counted, the window would read 40 ms of
    that call for 2 tokens. The timed wave asks for a call's tokens more than it times, so that call is past
    the window."""
    timed = [0.0] + [0.040 * (1 + i // 4) for i in range(8)]  # tokens 2..9 at 40 and 80 ms
    ending = [*timed, 0.120]  # the 10th token, alone in a call of 4 steps
    assert engine_check.steady_decode_s([ending, list(ending)], tokens=9) == pytest.approx(0.010)
    assert engine_check.steady_decode_s([ending, list(ending)], tokens=10) > 0.012


def test_a_timed_waves_tokens_of_one_step_arrive_together_for_every_request():
    """The engine emits a step's tokens to its requests' sinks one after another. Stamped as each sink was called,
    a multi-step call's tokens reached the first request before the last, and the decode TPOT's window, closed at
    the earliest stamp of a call, left that call's tokens out for the requests stamped later (1.31x the calls'
    rhythm on the H200 at C=256). Stamped at the step's end, every token of the last request after its first
    arrives with the first request's, and the decode TPOT is each request's window over its tokens in it."""
    loaded = engine_check.random_model("tiny")
    engine = engine_check.Engine(loaded, EngineConfig(dtype="float32", page_size=16, max_num_seqs=4,
                                                      max_num_batched_tokens=64, max_model_len=256,
                                                      kv_cache_memory=2**20, warmup=False),
                                 progress=False)
    requests = [BenchRequest(tuple(range(300 + 7 * i, 330 + 7 * i)), output_tokens=4) for i in range(4)]
    ttft, tpot, decode_tpot, arrivals = engine_check.timed_wave(engine, requests, 9, engine_check.Decoding())
    first, last = arrivals["first"], arrivals["last"]
    assert set(last[1:]) <= set(first)
    assert 0 < decode_tpot <= tpot * 1.5 and ttft * 1e3 == pytest.approx(max(first[0], last[0]))


def test_a_traced_decode_window_collects_only_calls_dispatched_with_the_tracer_running(monkeypatch):
    """The engine dispatches a call before it collects the one before. A call dispatched before the tracer
    started ran on while it started (a while on a GPU), so collected in the window, its tokens came without
    their device time: on the H200 the window read 4.03 ms a token at C=1 where the untraced calls came every
    4.90 ms. The window is opened only after a step has collected what ran while the tracer started."""
    loaded = engine_check.random_model("tiny")
    engine = engine_check.Engine(loaded, EngineConfig(dtype="float32", page_size=16, max_num_seqs=4,
                                                      max_num_batched_tokens=64, max_model_len=256,
                                                      kv_cache_memory=2**20, warmup=False),
                                 progress=False)
    state = dict(tracing=False, in_window=False)
    collected_in_window = []
    start_trace, annotation = jax.profiler.start_trace, jax.profiler.TraceAnnotation
    init, fetch = step_output.PendingStep.__init__, step_output.PendingStep.fetch

    def started(*args, **kwargs):
        start_trace(*args, **kwargs)
        state["tracing"] = True

    class Window(annotation):
        def __init__(self, name, **kwargs):
            super().__init__(name, **kwargs)
            self.window = name == device_profile._WINDOW

        def __enter__(self):
            state["in_window"] |= self.window
            return super().__enter__()

        def __exit__(self, *exc):
            state["in_window"] &= not self.window
            return super().__exit__(*exc)

    def dispatched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.with_tracer = state["tracing"]

    def collected(self):
        if state["in_window"]:
            collected_in_window.append(self.with_tracer)
        return fetch(self)

    monkeypatch.setattr(jax.profiler, "start_trace", started)
    monkeypatch.setattr(jax.profiler, "TraceAnnotation", Window)
    monkeypatch.setattr(step_output.PendingStep, "__init__", dispatched)
    monkeypatch.setattr(step_output.PendingStep, "fetch", collected)
    requests = [BenchRequest(tuple(range(100 + 7 * i, 130 + 7 * i)), output_tokens=4) for i in range(2)]
    profile = engine_check.profiled_decode(engine, requests, 16, engine_check.Decoding())
    assert profile["steps"] >= 16 and collected_in_window and all(collected_in_window)


def test_an_int8_run_measures_the_engine_on_int8_weights(tmp_path):
    """`--quantization int8`: the engine runs on the random weights quantized (what `gpu_check --quantization int8`
    measures against the float run), and the result says so."""
    Peaks(bandwidth_gbs=10.0, matmul_gflops=100.0, device="cpu").save(tmp_path / "peaks.json")
    out = tmp_path / "engine.json"
    assert engine_check.main(["--model", "tiny", "--peaks", str(tmp_path / "peaks.json"), "--out", str(out),
                              "--small", "--quantization", "int8", "--concurrency", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["quantization"] == "int8" and [level["concurrency"] for level in result["levels"]] == [2]
    assert result["levels"][0]["output_tokens"] > 0
    assert result["param_bytes"] < param_bytes(engine_check.random_model("tiny").model) / 1.5


def test_each_direct_step_compiles_once_off_the_main_thread_and_times_from_jits_cache(caplog):
    loaded = engine_check.random_model("tiny")
    steps = [engine_check.DirectStep(loaded, batch, 40, engine_check.PAGE_SIZE, "auto") for batch in (1, 4)]
    jax.config.update("jax_log_compiles", True)  # for every thread (`jax.log_compiles()` is the calling thread's)
    try:
        with caplog.at_level(logging.WARNING):
            engine_check.compile_in_parallel(steps)
            times = [step.time(repeats=2) for step in steps]
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.threadName for r in caplog.records if r.getMessage().startswith("Compiling jit(step)")]
    assert len(compiles) == len(steps)
    assert all(name.startswith("engine-check-compile") for name in compiles)
    assert [t.batch for t in times] == [1, 4] and all(t.step_s > 0 and t.attention_s > 0 for t in times)


def test_sustained_keeps_c_requests_in_flight_until_the_last_are_sent():
    """The sustained run is a closed loop of c clients: never more than c requests in the engine, and c of them
    whenever requests are still to be sent (a request's end lets the next in before the next step)."""
    loaded = engine_check.random_model("tiny")
    engine = engine_check.Engine(loaded, EngineConfig(dtype="float32", page_size=16, max_num_seqs=8,
                                                      max_num_batched_tokens=64, max_model_len=128,
                                                      kv_cache_memory=2**20, warmup=False),
                                 progress=False)
    requests = [BenchRequest(tuple(range(300, 300 + 5 + i)), output_tokens=2 + 3 * (i % 3)) for i in range(9)]
    submitted, in_engine, step, submit = [], [], engine.step, engine.submit

    def counted_step():
        in_engine.append((sum(engine.scheduler.num_requests()) + engine._inbox.qsize(), len(submitted)))
        step()

    def logged_submit(*args):
        submitted.append(args[-1])
        submit(*args)

    engine.step, engine.submit = counted_step, logged_submit
    seconds, profile = engine_check.sustained(engine, requests, 3, engine_check.Decoding())
    assert seconds > 0 and profile is None
    assert len(submitted) == len(set(submitted)) == len(requests)
    assert max(count for count, _ in in_engine) == 3
    assert all(count == 3 for count, sent in in_engine if sent < len(requests))
