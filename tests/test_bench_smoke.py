"""A short `bench serve` run against a live `sluice serve` with the real default model, and the pieces of
`make bench`'s llama.cpp baseline that need no llama.cpp build: its command, counters and bench output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llama_cpp, serve
from bench.dataset import BenchRequest
from bench.roofline import Peaks

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path.home() / ".cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"

needs_model = pytest.mark.skipif(not MODEL.exists(), reason="needs the default SmolLM2 GGUF (`sluice fetch`)")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    from bench.compare import free_port, wait_ready

    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--max-model-len", "128", "--kv-cache-memory", "16MiB",
         "--log-level", "warning"],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, timeout_s=600)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.slow
@needs_model
def test_bench_serve_streams_every_requested_token_and_writes_its_result(server_url: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    peaks = tmp_path / "peaks.json"
    Peaks(bandwidth_gbs=6.0, matmul_gflops=250.0, device="test").save(peaks)
    result = tmp_path / "serve.json"
    args = parser.parse_args([
        "--url", server_url, "--num-requests", "4", "--max-concurrency", "2", "--prompt-len-mean", "24",
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


def _request(prompt_tokens: int, output_tokens: int) -> BenchRequest:
    return BenchRequest(tuple(range(100, 100 + prompt_tokens)), output_tokens)


def test_llama_server_gets_a_slot_context_for_the_longest_request_in_every_slot() -> None:
    requests = [_request(500, 192), _request(16, 8)]  # 692 tokens: llama.cpp pads a slot to 768
    config = llama_cpp.ServerConfig(Path("m.gguf"), port=8123, threads=2, parallel=64,
                                    slot_context=llama_cpp.slot_context_for(requests))

    command = llama_cpp.server_command(config, binary=Path("llama-server"))

    assert config.slot_context == 768
    assert command == ["llama-server", "-m", "m.gguf", "-t", "2", "-np", "64", "-c", str(64 * 768),
                       "--host", "127.0.0.1", "--port", "8123", "--metrics"]


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


def test_llama_server_counters_vouch_for_a_phase_computed_afresh() -> None:
    before = llama_cpp.ServerCounters(prompt_tokens=224, prompt_tokens_cached=0, tokens_predicted=12, decode_calls=10)
    phase = [_request(500, 192), _request(16, 8)]

    counters = llama_cpp.parse_counters(METRICS.format(cached=0))

    assert counters == llama_cpp.ServerCounters(740, 0, 212, 90)
    llama_cpp.check_phase(counters - before, phase, "saturation")  # 516 prompt, 200 output tokens: exact


@pytest.mark.parametrize("cached, phase", [
    (16, [_request(500, 192), _request(16, 8)]),  # a prefix came from llama-server's prompt cache
    (0, [_request(500, 190), _request(16, 8)]),  # more tokens generated than asked for
])
def test_llama_server_counters_reject_cached_prompts_or_other_output_lengths(cached: int, phase: list[BenchRequest]) -> None:
    before = llama_cpp.ServerCounters(prompt_tokens=224, prompt_tokens_cached=0, tokens_predicted=12, decode_calls=10)

    with pytest.raises(RuntimeError, match="saturation"):
        llama_cpp.check_phase(llama_cpp.parse_counters(METRICS.format(cached=cached)) - before, phase, "saturation")


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
