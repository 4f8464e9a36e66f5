"""A short `bench serve` run against a live `sluice serve` with the real default model, and the pieces of
`make bench` that need no llama.cpp build: llama-server's settings, sweep and command, the servers' counters,
llama-bench's output, the formats, the rounds' order and the options."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench import compare, llama_cpp, serve, server_threads
from sluice.bench.compare_report import FORMATS, sweep_table
from sluice.bench.dataset import BenchRequest
from sluice.bench.roofline import Peaks
from sluice.bench.server_counters import ServerCounters, check_phase, parse_llama_server, parse_sluice
from test_api_e2e import ServerProcess, start_server

MODEL = Path.home() / ".cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"

needs_model = pytest.mark.skipif(not MODEL.exists(), reason="needs the default SmolLM2 GGUF (`sluice fetch`)")


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
                          "--kv-cache-memory", "16MiB", "--log-level", "warning", startup_timeout_s=600)
    yield server
    server.stop()


@pytest.mark.slow
@needs_model
def test_bench_serve_streams_every_requested_token_and_writes_its_result(server: ServerProcess, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    peaks = tmp_path / "peaks.json"
    Peaks(bandwidth_gbs=6.0, matmul_gflops=250.0, device="test").save(peaks)
    result = tmp_path / "serve.json"
    args = parser.parse_args([
        "--url", server.url, "--num-requests", "4", "--max-concurrency", "2", "--prompt-len-mean", "24",
        "--prompt-len-max", "48", "--output-len-mean", "6", "--output-len-max", "8",
        "--peaks", str(peaks), "--result-json", str(result), "--slo-ttft-ms", "600000",
    ])
    requests, _ = serve.load_dataset(args)

    assert serve.run(args) == 0

    data = json.loads(result.read_text())
    summary = data["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(r.output_tokens for r in requests)  # ignore_eos + max_tokens honoured
    assert summary["prompt_tokens"] == sum(r.prompt_tokens for r in requests)
    assert summary["output_throughput"] > 0
    assert summary["good_requests"] == 4
    assert 0 < summary["ttft_ms"]["median"] <= summary["e2e_ms"]["median"]
    assert data["roofline"]["fraction_of_limit"] > 0


@pytest.mark.slow
@needs_model
def test_server_threads_splits_a_running_servers_cpu_between_its_event_loop_engine_and_xla(
        server: ServerProcess, capsys: pytest.CaptureFixture) -> None:
    assert server_threads.main(["--url", server.url, "--pid", str(server.process.pid), "--concurrency", "4",
                                "--max-tokens", "60", "--window", "1", "--api", "chat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    calls = int(lines[0].split(": ")[1].split()[0])
    cpu_s = {line.rsplit(maxsplit=3)[0]: float(line.rsplit(maxsplit=3)[1]) for line in lines[2:]}
    assert calls > 0 and {"event loop", "engine"} <= cpu_s.keys()
    assert any(name.startswith("tf_") for name in cpu_s)  # XLA's CPU threads: the "device" here
    assert sum(cpu_s.values()) > 0


def _request(prompt_tokens: int, output_tokens: int) -> BenchRequest:
    return BenchRequest(tuple(range(100, 100 + prompt_tokens)), output_tokens)


def test_llama_server_gets_a_slot_context_for_the_longest_request_in_every_slot() -> None:
    requests = [_request(500, 192), _request(16, 8)]  # 692 tokens: llama.cpp pads a slot to 768
    config = llama_cpp.ServerConfig(Path("m.gguf"), port=8123, threads=2, setting=llama_cpp.Setting(parallel=64),
                                    slot_context=llama_cpp.slot_context_for(requests))

    command = llama_cpp.server_command(config, binary=Path("llama-server"))

    assert config.slot_context == 768
    assert command == ["llama-server", "-m", "m.gguf", "-t", "2", "-np", "64", "-no-kvu", "-c", str(64 * 768),
                       "--host", "127.0.0.1", "--port", "8123", "--metrics"]


def test_a_sweep_setting_becomes_llama_server_flags_and_is_labelled_by_them() -> None:
    setting = llama_cpp.Setting(parallel=32, kv_unified=True, batch=512, cache_ram_mib=0)
    config = llama_cpp.ServerConfig(Path("m.gguf"), port=8123, threads=2, setting=setting, slot_context=768)

    command = llama_cpp.server_command(config, binary=Path("llama-server"))

    assert command == ["llama-server", "-m", "m.gguf", "-t", "2", "-np", "32", "-kvu", "-b", "512", "-ub", "512",
                       "--cache-ram", "0", "-c", str(32 * 768), "--host", "127.0.0.1", "--port", "8123", "--metrics"]
    assert setting.label == "-np 32 -kvu -b 512 -ub 512 --cache-ram 0"


def test_the_sweep_tries_every_combination_of_the_values_given() -> None:
    settings = llama_cpp.sweep_settings(parallel=[16, 64], kv_unified=[False, True], batch=[None], cache_ram_mib=[None, 0])

    assert len(settings) == len(set(settings)) == 8
    assert settings[0] == llama_cpp.Setting(16, False, None, None)
    assert settings[-1] == llama_cpp.Setting(64, True, None, 0)


def test_the_best_setting_is_the_one_with_the_highest_saturation_output_throughput() -> None:
    sweep = [llama_cpp.Measured(llama_cpp.Setting(parallel), tps) for parallel, tps in ((16, 91.0), (32, 140.5), (64, 120.0))]

    assert llama_cpp.best(sweep).setting == llama_cpp.Setting(32)


def test_the_sweep_table_has_a_column_per_format_and_bolds_each_formats_best() -> None:
    low, high = llama_cpp.Setting(16), llama_cpp.Setting(64, kv_unified=True)
    sweeps = {"Q4_1": [llama_cpp.Measured(low, 80.0), llama_cpp.Measured(high, 120.0)],
              "Q8_0": [llama_cpp.Measured(low, 150.0), llama_cpp.Measured(high, 140.0)]}

    table = sweep_table(sweeps)

    assert table[0] == "| llama-server setting | Q4_1 | Q8_0 |"
    assert table[2:] == ["| `-np 16 -no-kvu` | 80.0 | **150.0** |", "| `-np 64 -kvu` | **120.0** | 140.0 |"]


def test_the_options_give_the_sweep_formats_and_repetitions() -> None:
    default = compare.parse_args([])
    short = compare.parse_args(["--formats", "Q8_0", "--repetitions", "1", "--llama-np", "64", "--llama-kvu", "on",
                                "--llama-batch", "512", "--llama-cache-ram", "default", "0", "--sweep-requests", "8"])

    assert default.formats == ["Q4_1", "Q8_0"] and default.repetitions == 3 and len(default.llama_settings) == 24
    assert short.formats == ["Q8_0"] and short.repetitions == 1 and short.sweep_requests == 8
    assert short.llama_settings == [llama_cpp.Setting(64, True, 512, None), llama_cpp.Setting(64, True, 512, 0)]


def test_each_format_names_its_gguf_type_and_sluices_quantization() -> None:
    assert FORMATS["Q4_1"].label == "Q4_1 (Sluice int4)"
    assert FORMATS["Q8_0"].label == "Q8_0 (Sluice int8)"


def test_a_gguf_already_in_the_format_is_served_as_it_is() -> None:
    source = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")

    assert compare.format_gguf(FORMATS["Q4_1"], source) == (source, None)


def test_the_q8_0_file_is_the_q4_1_file_requantized_by_llama_quantize() -> None:
    source = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")

    target = llama_cpp.requantized_path(source, "Q8_0", folder=Path("out"))

    assert target == Path("out/SmolLM2-135M-Instruct.Q4_1.Q8_0.gguf")
    assert llama_cpp.quantize_command(source, target, "Q8_0", binary=Path("llama-quantize")) == [
        "llama-quantize", "--allow-requantize", str(source), str(target), "Q8_0"]


def test_the_system_that_goes_first_alternates_from_round_to_round() -> None:
    assert [compare.round_order(i) for i in range(3)] == [
        ("Sluice", "llama.cpp"), ("llama.cpp", "Sluice"), ("Sluice", "llama.cpp")]


# As llama-server's /metrics writes them (HELP and TYPE lines, then the value).
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 740
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total {cached}
llamacpp:prompt_seconds_total 1.06782
llamacpp:tokens_predicted_total 212
llamacpp:n_decode_total 90
llamacpp:n_tokens_max 711
llamacpp:requests_processing 0
"""

# As Sluice's /metrics writes them (prometheus_client: counters with _total, values as floats).
SLUICE_METRICS = """# HELP sluice_prefix_cache_hit_tokens_total Prompt tokens served from the prefix cache
# TYPE sluice_prefix_cache_hit_tokens_total counter
sluice_prefix_cache_hit_tokens_total {cached}.0
sluice_prompt_tokens_total 740.0
sluice_generation_tokens_total 212.0
sluice_engine_steps_total 90.0
sluice_requests_total{{code="200"}} 4.0
"""

BEFORE = ServerCounters(prompt_tokens=224, prompt_tokens_cached=0, tokens_predicted=12, steps=10)


def test_llama_server_counters_vouch_for_a_phase_computed_afresh() -> None:
    phase = [_request(500, 192), _request(16, 8)]

    counters = parse_llama_server(METRICS.format(cached=0))

    assert counters == ServerCounters(740, 0, 212, 90)
    check_phase(counters - BEFORE, phase, "saturation")  # 516 prompt, 200 output tokens: exact


def test_sluice_counters_vouch_for_a_phase_computed_afresh() -> None:
    phase = [_request(500, 192), _request(16, 8)]

    counters = parse_sluice(SLUICE_METRICS.format(cached=0))

    assert counters == ServerCounters(740, 0, 212, 90)
    check_phase(counters - BEFORE, phase, "saturation")


@pytest.mark.parametrize("cached, phase", [
    (16, [_request(500, 192), _request(16, 8)]),  # a prefix came from the server's prompt or prefix cache
    (0, [_request(500, 190), _request(16, 8)]),  # more tokens generated than asked for
])
@pytest.mark.parametrize("metrics, parse", [(METRICS, parse_llama_server), (SLUICE_METRICS, parse_sluice)])
def test_server_counters_reject_cached_prompts_or_other_output_lengths(cached, phase, metrics, parse) -> None:
    with pytest.raises(RuntimeError, match="saturation"):
        check_phase(parse(metrics.format(cached=cached)) - BEFORE, phase, "saturation")


def test_llama_bench_json_gives_prompt_and_generation_rates() -> None:
    entries = [
        {"n_prompt": 128, "n_gen": 0, "n_threads": 2, "avg_ts": 231.5, "stddev_ts": 3.25},
        {"n_prompt": 0, "n_gen": 128, "n_threads": 2, "avg_ts": 88.9, "stddev_ts": 0.5},
    ]

    figures = llama_cpp.parse_bench_json(json.dumps(entries))

    assert figures == [llama_cpp.BenchFigure("pp128", 231.5, 3.25), llama_cpp.BenchFigure("tg128", 88.9, 0.5)]
    assert llama_cpp.bench_command(Path("m.gguf"), binary=Path("llama-bench")) == [
        "llama-bench", "-m", "m.gguf", "-t", "2", "-p", "128", "-n", "128", "-o", "json"]


def test_a_text_less_finish_chunk_carries_no_token_but_a_text_less_token_chunk_does() -> None:
    # llama-server ends a stream with {"text": "", "finish_reason": "length"} after the last token's chunk;
    # Sluice sends every token in its own chunk, with "" while a UTF-8 character is incomplete.
    finish_only = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 6}}
    incomplete_character = {"choices": [{"text": "", "index": 0, "finish_reason": None}]}
    last_token = {"choices": [{"text": " code", "index": 0, "finish_reason": "length"}]}
    usage_only = {"choices": [], "usage": {"completion_tokens": 6}}

    assert not serve._content_chunk(finish_only, "completions")
    assert serve._content_chunk(incomplete_character, "completions")
    assert serve._content_chunk(last_token, "completions")
    assert not serve._content_chunk(usage_only, "completions")


def test_host_overhead_times_every_phase_of_real_engine_steps_with_overlap_on_and_off(capsys) -> None:
    """The benchmark wraps the engine's phase functions by name: a renamed one would time nothing."""
    from sluice.bench import host_overhead

    assert host_overhead.main(["--batches", "2", "--vocab", "512", "--decode-steps", "4"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    512")]
    assert [row[2] for row in rows] == ["on", "off"]
    for row in rows:
        schedule, inputs, dispatch, collect, append, emit, host, wait, period, cpu = map(float, row[3:])
        assert min(schedule, inputs, dispatch, collect, append, emit) > 0
        assert host == pytest.approx(schedule + inputs + dispatch + collect + append + emit, abs=0.01)
        assert 0 < host < period
        assert 0 < cpu


# Prints the calling thread's allowed cores, then the other threads' (`Cpus_allowed_list`, e.g. "0-1" or "1").
THREAD_AFFINITIES = """
import os, jax.numpy as jnp
from sluice.bench.host_overhead import give_device_cores
give_device_cores(1)
(jnp.ones((512, 512)) @ jnp.ones((512, 512))).block_until_ready()
def allowed(task):
    return open(f"/proc/self/task/{task}/status").read().split("Cpus_allowed_list:")[1].split()[0]
print(allowed(os.getpid()), *{allowed(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()})
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_device_cores_keeps_xlas_threads_off_the_hosts_core() -> None:
    """`host_overhead --device-cores 1`: XLA's threads stay on the last core; the calling thread may use all."""
    last = str(max(os.sched_getaffinity(0)))
    run = subprocess.run([sys.executable, "-c", THREAD_AFFINITIES], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    main, *others = run.stdout.split()
    assert main != last and last in others, run.stdout
