"""A short `bench serve` run against a live `sluice serve` with the real default model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serve
from bench.roofline import Peaks

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path.home() / ".cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MODEL.exists(), reason="needs the default SmolLM2 GGUF (`sluice fetch`)"),
]


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
