"""What the HTTP side measures: Prometheus metrics, in a registry owned by one app (never the process-global
one), and the same latencies and errors kept raw for the dashboard (`dashboard/recent.py`).

Latencies are measured by the HTTP side from each request's arrival (`generation.py`); engine numbers are read
at scrape time from the stats snapshot the engine publishes after every step (no lock, at most a step old).
Ratios such as the prefix-cache hit rate are left to PromQL over the exported counters. What inference gateways and
vLLM's Grafana dashboards read is also exported under vLLM's names, labelled with the served model's name as vLLM's
are (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluice.batching.kv_store import KVStoreCounters
from sluice.batching.stats import EngineStats

from sluice.app.dashboard.recent import RecentRequests

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_stats: Callable[[], EngineStats | None],
                 model_name: Callable[[], str] = lambda: "") -> None:
        """`model_name`: the served model's name, the `model_name` label of the metrics under vLLM's names."""
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.requests = Counter(
            "sluice_requests", "HTTP requests by route and status code", ["route", "status"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "sluice_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "sluice_inter_token_latency_seconds",
            "Between consecutive streamed increments of one sequence, divided by the tokens they carry",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "sluice_e2e_request_latency_seconds",
            "From a request's arrival to its end, by outcome (success, error, abort)",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # vLLM's request latencies (what its dashboards chart), with the same observations as Sluice's own.
        self._vllm_ttft, self._vllm_itl, self._vllm_e2e = (
            Histogram(name, f"{documentation} (vLLM's name)", ["model_name"], buckets=_LATENCY_BUCKETS,
                      registry=self.registry)
            for name, documentation in (
                ("vllm:time_to_first_token_seconds", "From a request's arrival to its first generated token"),
                ("vllm:inter_token_latency_seconds", "Between consecutive output tokens of one sequence"),
                ("vllm:e2e_request_latency_seconds", "From a request's arrival to its end"),
            ))
        self.stream_stalls = Counter(
            "sluice_stream_stalls", "Streams aborted because their reader accepted nothing for the stall timeout",
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats, model_name))
        self.recent = RecentRequests()

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self._vllm_ttft.labels(self._model_name()).observe(seconds)
        self.recent.ttft.append(seconds)

    def inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        self._vllm_itl.labels(self._model_name()).observe(seconds)
        self.recent.itl.append(seconds)

    def finished(self, outcome: str, seconds: float) -> None:
        self.e2e_latency.labels(outcome=outcome).observe(seconds)
        self._vllm_e2e.labels(self._model_name()).observe(seconds)
        if outcome == "success":
            self.recent.e2e.append(seconds)

    def responded(self, route: str, status: int, error_message: str | None) -> None:
        """Every HTTP response; `error_message` that of an error response's body. A /health (or /ping) 503
        (loading, draining) is the probe's answer, not a failure: it is not listed."""
        self.requests.labels(route=route, status=str(status)).inc()
        if error_message is not None and route not in ("/health", "/ping"):
            self.recent.error(status, route, error_message)

    def stream_failed(self, status: int, request_id: str, message: str) -> None:
        """A stream that ended in an error event (`status` its error's) or whose client left (499) after its
        200 went out."""
        self.recent.error(status, request_id, message)

    def stream_stalled(self) -> None:
        self.stream_stalls.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_stats: Callable[[], EngineStats | None], model_name: Callable[[], str]) -> None:
        self._engine_stats = engine_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        if stats is None:
            return
        gauges = [
            ("sluice_num_requests_running", "Requests with a sequence in the running batch", stats.num_requests_running),
            ("sluice_num_requests_waiting", "Requests waiting for a batch slot", stats.num_requests_waiting),
            ("sluice_num_seqs_running", "Sequences in the running batch", stats.num_seqs_running),
            ("sluice_num_seqs_waiting", "Sequences waiting for a batch slot", stats.num_seqs_waiting),
            ("sluice_kv_pages_used", "KV-cache pages held by sequences", stats.kv_pages_used),
            ("sluice_kv_pages_total", "KV-cache pages in the pool", stats.kv_pages_total),
        ]
        counters = [
            ("sluice_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", stats.prefix_cache_hit_tokens),
            ("sluice_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_query_tokens),
            ("sluice_prompt_tokens", "Prompt tokens processed (each prompt once, when its prefill completes)",
             stats.prompt_tokens_total),
            ("sluice_generation_tokens", "Tokens generated", stats.generation_tokens_total),
            ("sluice_num_preemptions", "Sequences preempted to free KV pages", stats.num_preemptions),
            ("sluice_engine_steps", "Engine steps run", stats.num_steps),
            ("sluice_engine_step_failures", "Steps that failed: every request in flight ended with an error, and the "
             "engine started over with an empty KV pool", stats.num_step_failures),
        ]
        if stats.spec is not None:
            counters += [
                ("sluice_spec_decode_num_drafts", "Sequences that verified drafts, counted per step", stats.spec.num_drafts),
                ("sluice_spec_decode_num_draft_tokens", "Draft tokens verified", stats.spec.num_draft_tokens),
                ("sluice_spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.spec.num_accepted_tokens),
            ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        yield from _vllm_named(stats, self._model_name())
        if stats.prefix_store is not None:
            yield from _prefix_store_metrics(stats.prefix_store)
        if stats.spec is not None:
            per_position = CounterMetricFamily("sluice_spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted, by draft position", labels=["position"])
            for position, value in enumerate(stats.spec.accepted_per_position):
                per_position.add_metric([str(position)], value)
            yield per_position


def _prefix_store_metrics(store: KVStoreCounters) -> Iterator[Metric]:
    """The persistent prefix cache's tiers (host RAM, disk): lookups, what each holds, and the files found corrupt."""
    tiers = {"ram": store.ram, "disk": store.disk}
    families = [
        (CounterMetricFamily, "sluice_prefix_store_hits", "Pages the persistent prefix cache found, by tier", "hits"),
        (CounterMetricFamily, "sluice_prefix_store_misses", "Pages the persistent prefix cache lacked, by tier",
         "misses"),
        (CounterMetricFamily, "sluice_prefix_store_evictions", "Pages evicted from a tier (least recently used)",
         "evictions"),
        (GaugeMetricFamily, "sluice_prefix_store_pages", "Pages held, by tier", "pages"),
        (GaugeMetricFamily, "sluice_prefix_store_bytes", "Bytes held, by tier", "bytes"),
    ]
    for family, name, documentation, field in families:
        metric = family(name, documentation, labels=["tier"])
        for tier, counters in tiers.items():
            metric.add_metric([tier], getattr(counters, field))
        yield metric
    yield CounterMetricFamily("sluice_prefix_store_corrupt", "Page files found torn, truncated or corrupt (removed, "
                              "never served)", value=store.corrupt)
    yield CounterMetricFamily("sluice_prefix_store_dropped_writes", "Pages not written to disk (the writer's queue "
                              "was full, or the write failed)", value=store.dropped_writes)


def _vllm_named(stats: EngineStats, model_name: str) -> Iterator[Metric]:
    """The engine's numbers under vLLM's names, labelled with the served model's name: read by inference gateways
    (the Gateway API Inference Extension, llm-d) to pick a replica by load and KV use, and by vLLM's dashboards;
    the same values as Sluice's own."""
    usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
    families = [
        (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch", stats.num_requests_running),
        (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for a batch slot",
         stats.num_requests_waiting),
        (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use, 0 to 1", usage),
        (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
         stats.prefix_cache_query_tokens),
        (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
         stats.prefix_cache_hit_tokens),
        (CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens processed", stats.prompt_tokens_total),
        (CounterMetricFamily, "vllm:generation_tokens", "Tokens generated", stats.generation_tokens_total),
        (CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted to free KV pages", stats.num_preemptions),
    ]
    for family, name, documentation, value in families:
        metric = family(name, f"{documentation} (vLLM's name)", labels=["model_name"])
        metric.add_metric([model_name], value)
        yield metric
    if stats.max_loras:
        # As vLLM's: the adapters in labels (comma-separated names), the time of the snapshot as the value. Inference
        # gateways read it to send a request where its adapter already runs.
        info = GaugeMetricFamily("vllm:lora_requests_info", "max_loras, and the adapters of the running and the "
                                 "waiting requests (vLLM's name)",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(stats.max_loras), ",".join(stats.lora_running), ",".join(stats.lora_waiting)],
                        time.time())
        yield info
