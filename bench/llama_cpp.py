"""llama.cpp, the CPU peer of `make bench`: where it is built, llama-server's command and counters, llama-bench's figures.

`make bench` builds `llama-server` and `llama-bench` once into `.llama-cpp/build/bin` from the llama.cpp
sources vendored in the llama-cpp-python sdist (see the Makefile). The comparison serves the same GGUF
with `llama-server -t 2 -np 64 -c N` (N: 64 slots of the workload's longest request) and sends it the
same requests as Sluice through the same load generator (`bench/serve.py`).

Two behaviours of llama-server matter for a fair comparison. It keeps each slot's last prompt (and, with
its default `--cache-ram`, a host-memory copy of idle slots) and reuses the longest common prefix of a new
prompt (`cache_prompt` is on by default): every phase therefore gets fresh token ids, and the server's
`/metrics` counters prove it (`prompt_tokens_cached_total` must not move). Its per-slot context is the
total `-c` divided by `-np`, rounded up to a multiple of 256, so `-c` must hold 64 of the longest request.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.dataset import BenchRequest

ROOT = Path(__file__).resolve().parent.parent
BUILD_BIN = ROOT / ".llama-cpp/build/bin"
# llama.cpp pads each slot's context up to a multiple of this many tokens.
CONTEXT_PADDING = 256


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    port: int
    threads: int = 2
    parallel: int = 64
    slot_context: int = 1024

    @property
    def context(self) -> int:
        """The total `-c`: every slot holds `slot_context` tokens."""
        return self.parallel * self.slot_context


def slot_context_for(requests: Sequence[BenchRequest]) -> int:
    """Tokens one slot needs for the longest request (prompt + output), padded as llama.cpp pads it."""
    longest = max(len(r.prompt) + r.output_tokens for r in requests)
    return math.ceil(longest / CONTEXT_PADDING) * CONTEXT_PADDING


def server_command(config: ServerConfig, binary: Path = BUILD_BIN / "llama-server") -> list[str]:
    """llama-server with continuous batching over `parallel` slots, and /metrics for the token counters."""
    return [
        str(binary), "-m", str(config.model), "-t", str(config.threads), "-np", str(config.parallel),
        "-c", str(config.context), "--host", "127.0.0.1", "--port", str(config.port), "--metrics",
    ]


@dataclass(frozen=True)
class ServerCounters:
    """llama-server's cumulative token counters (Prometheus `/metrics`, names without the `llamacpp:` prefix)."""

    prompt_tokens: int  # prompt tokens computed, excluding those reused from the prompt cache
    prompt_tokens_cached: int
    tokens_predicted: int
    decode_calls: int  # llama_decode() calls: one per engine step

    def __sub__(self, earlier: ServerCounters) -> ServerCounters:
        return ServerCounters(
            self.prompt_tokens - earlier.prompt_tokens,
            self.prompt_tokens_cached - earlier.prompt_tokens_cached,
            self.tokens_predicted - earlier.tokens_predicted,
            self.decode_calls - earlier.decode_calls,
        )


_METRIC = re.compile(r"^llamacpp:(\w+)\s+(\S+)$", re.MULTILINE)


def parse_counters(metrics_text: str) -> ServerCounters:
    values = {name: float(value) for name, value in _METRIC.findall(metrics_text)}
    return ServerCounters(
        prompt_tokens=int(values["prompt_tokens_total"]),
        prompt_tokens_cached=int(values["prompt_tokens_cached_total"]),
        tokens_predicted=int(values["tokens_predicted_total"]),
        decode_calls=int(values["n_decode_total"]),
    )


def counters_reader(url: str) -> Callable[[], ServerCounters]:
    """Reads the counters of the llama-server at `url` (started with `--metrics`) when called."""

    def read() -> ServerCounters:
        response = httpx.get(url + "/metrics", timeout=30)
        response.raise_for_status()
        return parse_counters(response.text)

    return read


def check_phase(counters: ServerCounters, requests: Sequence[BenchRequest], phase: str) -> None:
    """Raises unless llama-server computed every prompt token of the phase afresh (nothing from its prompt
    cache) and generated exactly the requested output tokens."""
    prompt = sum(len(r.prompt) for r in requests)
    output = sum(r.output_tokens for r in requests)
    if counters.prompt_tokens_cached or counters.prompt_tokens != prompt or counters.tokens_predicted != output:
        raise RuntimeError(
            f"llama-server {phase}: computed {counters.prompt_tokens} prompt tokens ({counters.prompt_tokens_cached} "
            f"from its cache) and {counters.tokens_predicted} output tokens; the phase sent {prompt} and asked for {output}"
        )


@dataclass(frozen=True)
class BenchFigure:
    """One llama-bench test: `pp128` (prompt processing of 128 tokens) or `tg128` (generating 128)."""

    test: str
    tokens_per_s: float
    stddev: float


def bench_command(
    model: Path, threads: int = 2, prompt_tokens: int = 128, gen_tokens: int = 128, binary: Path = BUILD_BIN / "llama-bench"
) -> list[str]:
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens), "-o", "json"]


def parse_bench_json(text: str) -> list[BenchFigure]:
    """llama-bench's `-o json` output: one entry per test, with prompt (`n_prompt`) and generated (`n_gen`)
    token counts and the mean and standard deviation of tokens/s over its repetitions."""
    figures = []
    for entry in json.loads(text):
        test = "+".join(f"{kind}{n}" for kind, n in (("pp", entry["n_prompt"]), ("tg", entry["n_gen"])) if n)
        figures.append(BenchFigure(test, float(entry["avg_ts"]), float(entry["stddev_ts"])))
    return figures


def run_bench(command: list[str]) -> list[BenchFigure]:
    return parse_bench_json(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
