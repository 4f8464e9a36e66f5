"""The benchmark's arithmetic: per-request latencies from what a streaming client saw, and a run's summary.

Definitions (all times from one monotonic clock, reported in milliseconds):
- TTFT: first chunk carrying output tokens minus the moment the request was sent.
- E2E: the end of the response stream minus the moment the request was sent.
- TPOT (time per output token, one value per request): (E2E - TTFT) / (output_tokens - 1); undefined
  for a one-token output.
- ITL (inter-token latency, one value per token after the first chunk): the gap before a chunk is split
  evenly over the tokens the chunk carries, so a chunk of k tokens after a gap g counts k times as g / k.
  Averaged over tokens, ITL then weighs every token equally, as TPOT does; a server that sends one token
  per chunk (Sluice, vLLM) makes it the plain gap between chunks.
- Goodput: requests per second that succeeded and met every SLO given (TTFT and/or TPOT).
Percentiles interpolate linearly between closest ranks (NumPy's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds on `time.perf_counter`'s clock.

    `chunk_times[i]` is when the i-th stream chunk carrying output tokens arrived and `chunk_tokens[i]`
    how many tokens it carried. `error` is None for a request that completed. `cached_tokens`: the prompt tokens
    its usage reports served from a prefix cache.
    """

    sent_at: float
    done_at: float
    chunk_times: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent_at

    @property
    def e2e(self) -> float:
        return self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        gaps: list[float] = []
        for previous, now, tokens in zip(self.chunk_times, self.chunk_times[1:], self.chunk_tokens[1:]):
            gaps.extend([(now - previous) / tokens] * tokens)
        return gaps


@dataclass(frozen=True)
class Slo:
    """Service-level objective for goodput; None leaves a bound out."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Distribution:
    """Mean, median, p90 and p99 of a latency in milliseconds (all 0.0 for no values)."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=np.float64) * 1e3
        return cls(float(ms.mean()), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_decode_batch: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    slo: Slo
    good_requests: int
    goodput: float


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> Summary:
    """A run's figures; throughputs count completed requests only, over the run's wall time `duration_s`.

    `mean_decode_batch` is the mean number of requests past their first token at any moment
    (their total decode time over the run's duration, Little's law): the batch the server decoded at.
    """
    done = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r))
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        mean_decode_batch=sum(r.e2e - r.ttft for r in done) / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft for r in done]),
        tpot_ms=Distribution.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itls()]),
        e2e_ms=Distribution.of_seconds([r.e2e for r in done]),
        slo=slo,
        good_requests=good,
        goodput=good / duration_s,
    )


@dataclass(frozen=True)
class Spread:
    """One figure over repeated runs: the median and the range. Formats as `median (min-max)` with the format
    spec applied to each: f"{spread:.1f}" -> "358.3 (350.1-360.2)"."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        low, high = min(values), max(values)  # raises for no values
        return cls(float(np.median(values)), float(low), float(high))

    def __format__(self, spec: str) -> str:
        return f"{self.median:{spec}} ({self.min:{spec}}-{self.max:{spec}})"
