"""The servers' own token counters (Prometheus `/metrics`), read before and after each phase of `make bench`.

A phase counts only if the server, by its own count as well as by the streamed usage, computed every prompt
token it was sent afresh (nothing reused from a prompt or prefix cache) and generated exactly the tokens asked
for. The two servers name and define their counters differently:
- llama-server (`--metrics`): `llamacpp:prompt_tokens_total` (excluding tokens reused from its prompt cache),
  `llamacpp:prompt_tokens_cached_total`, `llamacpp:tokens_predicted_total`, `llamacpp:n_decode_total`.
- Sluice (`app/metrics.py`): `sluice_prompt_tokens_total` (whole prompts, cached prefixes included),
  `sluice_prefix_cache_hit_tokens_total`, `sluice_generation_tokens_total`, `sluice_engine_steps_total`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from sluice.bench.dataset import BenchRequest


@dataclass(frozen=True)
class ServerCounters:
    """A server's cumulative token counters, in one meaning for both servers."""

    prompt_tokens: int  # prompt tokens computed, excluding those reused from a cache
    prompt_tokens_cached: int
    tokens_predicted: int
    steps: int  # model calls: llama_decode() calls, Sluice's engine steps

    def __sub__(self, earlier: ServerCounters) -> ServerCounters:
        return ServerCounters(
            self.prompt_tokens - earlier.prompt_tokens,
            self.prompt_tokens_cached - earlier.prompt_tokens_cached,
            self.tokens_predicted - earlier.tokens_predicted,
            self.steps - earlier.steps,
        )


_LLAMA_SERVER_METRIC = re.compile(r"^llamacpp:(\w+)\s+(\S+)$", re.MULTILINE)
_SLUICE_METRIC = re.compile(r"^sluice_(\w+)\s+(\S+)$", re.MULTILINE)


def _values(pattern: re.Pattern[str], metrics_text: str) -> dict[str, int]:
    return {name: int(float(value)) for name, value in pattern.findall(metrics_text)}


def parse_llama_server(metrics_text: str) -> ServerCounters:
    values = _values(_LLAMA_SERVER_METRIC, metrics_text)
    return ServerCounters(
        prompt_tokens=values["prompt_tokens_total"],
        prompt_tokens_cached=values["prompt_tokens_cached_total"],
        tokens_predicted=values["tokens_predicted_total"],
        steps=values["n_decode_total"],
    )


def parse_sluice(metrics_text: str) -> ServerCounters:
    values = _values(_SLUICE_METRIC, metrics_text)
    cached = values["prefix_cache_hit_tokens_total"]
    return ServerCounters(
        prompt_tokens=values["prompt_tokens_total"] - cached,
        prompt_tokens_cached=cached,
        tokens_predicted=values["generation_tokens_total"],
        steps=values["engine_steps_total"],
    )


def reader(url: str, parse: Callable[[str], ServerCounters]) -> Callable[[], ServerCounters]:
    """Reads the counters of the server at `url` when called."""

    def read() -> ServerCounters:
        response = httpx.get(url + "/metrics", timeout=30)
        response.raise_for_status()
        return parse(response.text)

    return read


def check_phase(counters: ServerCounters, requests: Sequence[BenchRequest], phase: str) -> None:
    """Raises unless the server computed every prompt token of the phase afresh (nothing from a cache) and
    generated exactly the requested output tokens; `counters` are the phase's (after - before)."""
    prompt = sum(len(r.prompt) for r in requests)
    output = sum(r.output_tokens for r in requests)
    if counters.prompt_tokens_cached or counters.prompt_tokens != prompt or counters.tokens_predicted != output:
        raise RuntimeError(
            f"{phase}: the server computed {counters.prompt_tokens} prompt tokens ({counters.prompt_tokens_cached} "
            f"from its cache) and {counters.tokens_predicted} output tokens; the phase sent {prompt} and asked for {output}"
        )
