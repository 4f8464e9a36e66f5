"""The dashboard's numbers: one sample a second from the engine's stats snapshots and the HTTP side's
recent requests, kept for 15 minutes in a bounded ring buffer.

Rates come from the differences of the snapshot's counters between ticks, so every step counts though the
engine is only looked at once a second: output and prompt tokens, FLOPs and bytes over the time spent
stepping (the fraction of the device's peaks the steps reach), decode batch sizes, queue waits. Latency
percentiles are over the raw TTFT / ITL / E2E values of the last minute; the decode batch size histogram,
prefix-cache hit rate and draft acceptance over the last minute too.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np

from sluice.batching.stats import EngineStats
from sluice.model.roofline import Peaks

from sluice.app.dashboard.recent import ERROR_KINDS, ErrorEntry, Taken

HISTORY_S = 15 * 60
WINDOW_S = 60.0
RECENT_ERRORS = 8
PERCENTILES = (50, 90, 99)

Percentiles = tuple[float, float, float]


@dataclass(frozen=True)
class Sample:
    """One second: rates over that second unless `_1m` (the last minute); `decode_batch` is the mean decode
    batch of its steps and `queue_wait_ms` the mean wait of the sequences admitted in it (None when there were
    none); latency percentiles (p50, p90, p99, ms), prefix-cache hit rate and draft acceptance over the last
    minute; `compute_fraction` / `memory_fraction`: FLOPs and bytes per second of stepping over the device's
    peaks; `busy_fraction`: the share of the second the engine spent stepping; `errors`: by kind, this second;
    `store_*`: the persistent prefix cache's tiers (MB held in RAM and on disk, and the share of its lookups
    found in either over the last minute), None without one."""

    t: float
    output_tps: float
    prompt_tps: float
    output_tps_1m: float
    prompt_tps_1m: float
    decode_batch: float | None
    running: int
    waiting: int
    queue_wait_ms: float | None
    kv_used: int
    kv_total: int
    prefix_hit_rate: float | None
    ttft_ms: Percentiles | None
    itl_ms: Percentiles | None
    e2e_ms: Percentiles | None
    compute_fraction: float | None
    memory_fraction: float | None
    busy_fraction: float
    spec_acceptance: float | None
    errors: dict[str, int]
    store_ram_mb: float | None = None
    store_disk_mb: float | None = None
    store_hit_rate: float | None = None

    def as_json(self) -> dict:
        """Numbers to 4 significant digits (what a chart shows, in a third of the bytes); the time to the ms."""
        return _json(self)

    @cached_property
    def json_text(self) -> str:
        """`as_json` encoded, once: every dashboard that opens gets the history."""
        return json.dumps(self.as_json(), separators=(",", ":"))


def _json(record: Sample | ErrorEntry) -> dict:
    fields = asdict(record)
    times = {name: round(fields.pop(name), 3) for name in ("t", "unix_s") if name in fields}
    return {**_rounded(fields), **times}


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


@dataclass
class _LatencyWindow:
    """Values of the last `window_s` seconds, one array per tick."""

    window_s: float
    arrays: deque[tuple[float, np.ndarray]] = field(default_factory=deque)

    def add(self, now: float, values: list[float]) -> Percentiles | None:
        if values:
            self.arrays.append((now, np.asarray(values)))
        while self.arrays and self.arrays[0][0] <= now - self.window_s:
            self.arrays.popleft()
        if not self.arrays:
            return None
        ms = 1e3 * np.percentile(np.concatenate([a for _, a in self.arrays]), PERCENTILES)
        return (float(ms[0]), float(ms[1]), float(ms[2]))


class Timeline:
    """`tick` once a second with the engine's latest snapshot and what the HTTP side saw since the last tick;
    `samples` holds the last `history_s` of them. `peaks`: of all the devices the model runs on (None: no
    roofline fractions)."""

    def __init__(self, peaks: Peaks | None, history_s: int = HISTORY_S, window_s: float = WINDOW_S) -> None:
        self.peaks = peaks
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=history_s)
        self.decode_batch_histogram: list[int] = []
        self.error_totals: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self.recent_errors: deque[ErrorEntry] = deque(maxlen=RECENT_ERRORS)
        self._snapshots: deque[tuple[float, EngineStats]] = deque()
        self._latency = {kind: _LatencyWindow(window_s) for kind in ("ttft", "itl", "e2e")}

    def tick(self, now: float, unix_now: float, stats: EngineStats, taken: Taken) -> Sample:
        """`now`: a monotonic clock in seconds; `unix_now` stamps the sample."""
        previous = self._snapshots[-1] if self._snapshots else (now, stats)
        self._snapshots.append((now, stats))
        while self._snapshots[0][0] < now - self.window_s:
            self._snapshots.popleft()
        first_t, first = self._snapshots[0]
        dt, dt_window = max(now - previous[0], 1e-9), max(now - first_t, 1e-9)
        last = previous[1]

        steps = np.subtract(stats.decode_batch_steps, last.decode_batch_steps)[1:]
        sizes = np.arange(1, len(steps) + 1)
        busy = stats.busy_s - last.busy_s
        # FLOPs and bytes per second of stepping over the peaks: (work / peak rate) / time spent stepping.
        compute = memory = None
        if self.peaks is not None:
            compute = _ratio((stats.flops - last.flops) / (self.peaks.matmul_gflops * 1e9), busy)
            memory = _ratio((stats.bytes - last.bytes) / (self.peaks.bandwidth_gbs * 1e9), busy)
        self.decode_batch_histogram = np.subtract(stats.decode_batch_steps, first.decode_batch_steps)[1:].tolist()
        for entry in taken.errors:
            self.error_totals[entry.kind] += 1
        self.recent_errors.extend(taken.errors)
        spec = (stats.spec, first.spec) if stats.spec is not None and first.spec is not None else None
        store = stats.prefix_store
        store_hit_rate = None
        if store is not None and first.prefix_store is not None:
            before = first.prefix_store
            store_hit_rate = _ratio(store.ram.hits + store.disk.hits - before.ram.hits - before.disk.hits,
                                    store.ram.hits + store.ram.misses - before.ram.hits - before.ram.misses)

        sample = Sample(
            t=unix_now,
            output_tps=(stats.generation_tokens_total - last.generation_tokens_total) / dt,
            prompt_tps=(stats.prompt_tokens_total - last.prompt_tokens_total) / dt,
            output_tps_1m=(stats.generation_tokens_total - first.generation_tokens_total) / dt_window,
            prompt_tps_1m=(stats.prompt_tokens_total - first.prompt_tokens_total) / dt_window,
            decode_batch=_ratio(float(sizes @ steps), float(steps.sum())),
            running=stats.num_requests_running,
            waiting=stats.num_requests_waiting,
            queue_wait_ms=_ratio(1e3 * (stats.queue_wait_s - last.queue_wait_s),
                                 stats.num_admitted - last.num_admitted),
            kv_used=stats.kv_pages_used,
            kv_total=stats.kv_pages_total,
            prefix_hit_rate=_ratio(stats.prefix_cache_hit_tokens - first.prefix_cache_hit_tokens,
                                   stats.prefix_cache_query_tokens - first.prefix_cache_query_tokens),
            ttft_ms=self._latency["ttft"].add(now, taken.ttft),
            itl_ms=self._latency["itl"].add(now, taken.itl),
            e2e_ms=self._latency["e2e"].add(now, taken.e2e),
            compute_fraction=compute,
            memory_fraction=memory,
            busy_fraction=min(busy / dt, 1.0),
            spec_acceptance=None if spec is None else _ratio(spec[0].num_accepted_tokens - spec[1].num_accepted_tokens,
                                                             spec[0].num_draft_tokens - spec[1].num_draft_tokens),
            errors={kind: sum(e.kind == kind for e in taken.errors) for kind in ERROR_KINDS},
            store_ram_mb=None if store is None else store.ram.bytes / 1e6,
            store_disk_mb=None if store is None else store.disk.bytes / 1e6,
            store_hit_rate=store_hit_rate,
        )
        self.samples.append(sample)
        return sample

    def live(self) -> dict:
        """What is shown only as it is now: the last minute's decode batch histogram (steps by batch size
        from 1), error totals since start and the last few errors, newest first."""
        return {
            "decode_batch_histogram": self.decode_batch_histogram,
            "error_totals": self.error_totals,
            "recent_errors": [_json(e) for e in reversed(self.recent_errors)],
        }
