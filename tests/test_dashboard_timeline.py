"""The dashboard's aggregation: per-second samples rebuilt exactly from the engine's summed counters, latency
percentiles over a sliding minute, errors by kind, and a bounded history."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.app.dashboard.recent import ErrorEntry, RecentRequests, Taken, error_kind
from sluice.app.dashboard.timeline import HISTORY_S, Timeline
from sluice.batching.speculation import SpecCounters
from sluice.batching.stats import EngineStats
from sluice.model.roofline import Peaks

IDLE = EngineStats(
    num_requests_running=0, num_requests_waiting=0, num_seqs_running=0, num_seqs_waiting=0, kv_pages_used=0,
    kv_pages_total=100, prefix_cache_hit_tokens=0, prefix_cache_query_tokens=0, num_preemptions=0,
    prompt_tokens_total=0, generation_tokens_total=0, num_steps=0, last_step=None,
    decode_batch_steps=(0, 0, 0, 0, 0),
)
NOTHING = Taken([], [], [], [])
PEAKS = Peaks(bandwidth_gbs=10.0, matmul_gflops=100.0, device="test")


def test_token_rates_are_counter_differences_over_the_second_and_the_minute():
    timeline = Timeline(PEAKS)
    timeline.tick(0.0, 1000.0, IDLE, NOTHING)
    timeline.tick(1.0, 1001.0, replace(IDLE, generation_tokens_total=50, prompt_tokens_total=200), NOTHING)
    sample = timeline.tick(2.0, 1002.0, replace(IDLE, generation_tokens_total=80, prompt_tokens_total=200), NOTHING)
    assert (sample.output_tps, sample.prompt_tps) == (30.0, 0.0)
    assert (sample.output_tps_1m, sample.prompt_tps_1m) == (40.0, 100.0)
    assert sample.t == 1002.0


def test_decode_batch_is_the_mean_over_every_step_and_the_histogram_spans_the_minute():
    timeline = Timeline(PEAKS)
    timeline.tick(0.0, 0.0, IDLE, NOTHING)
    first = timeline.tick(1.0, 1.0, replace(IDLE, decode_batch_steps=(5, 1, 0, 0, 3)), NOTHING)
    assert first.decode_batch == (1 * 1 + 4 * 3) / 4  # steps without decodes (size 0) do not count
    second = timeline.tick(2.0, 2.0, replace(IDLE, decode_batch_steps=(5, 1, 2, 0, 3)), NOTHING)
    assert second.decode_batch == 2.0
    assert timeline.live()["decode_batch_histogram"] == [1, 2, 0, 3]  # sizes 1..4
    assert timeline.tick(3.0, 3.0, replace(IDLE, decode_batch_steps=(5, 1, 2, 0, 3)), NOTHING).decode_batch is None


def test_roofline_fractions_are_flops_and_bytes_per_second_of_stepping_over_the_peaks():
    timeline = Timeline(PEAKS)
    timeline.tick(0.0, 0.0, IDLE, NOTHING)
    sample = timeline.tick(1.0, 1.0, replace(IDLE, busy_s=0.5, flops=10e9, bytes=4e9), NOTHING)
    assert sample.compute_fraction == pytest.approx(10e9 / 0.5 / 100e9)
    assert sample.memory_fraction == pytest.approx(4e9 / 0.5 / 10e9)
    assert sample.busy_fraction == 0.5
    assert Timeline(None).tick(0.0, 0.0, IDLE, NOTHING).compute_fraction is None


def test_queue_wait_is_the_mean_of_the_admissions_in_the_second():
    timeline = Timeline(PEAKS)
    timeline.tick(0.0, 0.0, IDLE, NOTHING)
    sample = timeline.tick(1.0, 1.0, replace(IDLE, queue_wait_s=0.3, num_admitted=3), NOTHING)
    assert sample.queue_wait_ms == pytest.approx(100.0)


def test_prefix_hit_rate_and_draft_acceptance_cover_the_last_minute():
    timeline = Timeline(PEAKS)
    timeline.tick(0.0, 0.0, replace(IDLE, spec=SpecCounters()), NOTHING)
    stats = replace(IDLE, prefix_cache_hit_tokens=30, prefix_cache_query_tokens=120,
                    spec=SpecCounters(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=12))
    sample = timeline.tick(1.0, 1.0, stats, NOTHING)
    assert (sample.prefix_hit_rate, sample.spec_acceptance) == (0.25, 0.75)
    assert timeline.tick(2.0, 2.0, IDLE, NOTHING).spec_acceptance is None  # speculation off


def test_latency_percentiles_are_over_the_last_minute_of_raw_values():
    timeline = Timeline(PEAKS, window_s=60.0)
    timeline.tick(0.0, 0.0, IDLE, Taken(ttft=[1.0] * 100, itl=[], e2e=[], errors=[]))
    taken = Taken(ttft=[0.1 * i for i in range(1, 101)], itl=[0.02], e2e=[], errors=[])
    sample = timeline.tick(30.0, 30.0, IDLE, taken)
    assert sample.ttft_ms[0] == pytest.approx(1000.0)  # half the values are the first tick's 1 s
    assert sample.itl_ms == pytest.approx((20.0, 20.0, 20.0))
    assert sample.e2e_ms is None
    later = timeline.tick(61.0, 61.0, IDLE, NOTHING)  # the first tick's values have left the window
    assert later.ttft_ms[1] == pytest.approx(9010.0)  # p90 of 0.1 .. 10 s, interpolated


def test_errors_are_counted_by_kind_and_the_last_few_listed_newest_first():
    timeline = Timeline(PEAKS)
    errors = [ErrorEntry(float(i), "429" if i % 2 else "400", 429 if i % 2 else 400, "/v1/completions", f"e{i}")
              for i in range(10)]
    sample = timeline.tick(0.0, 0.0, IDLE, Taken([], [], [], errors))
    assert sample.errors == {"400": 5, "429": 5, "5xx": 0, "aborted": 0}
    live = timeline.live()
    assert live["error_totals"]["429"] == 5
    assert [e["message"] for e in live["recent_errors"]][:2] == ["e9", "e8"]
    assert len(live["recent_errors"]) < 10


def test_history_is_a_ring_of_fifteen_minutes_of_samples():
    timeline = Timeline(PEAKS)
    for second in range(HISTORY_S + 10):
        timeline.tick(float(second), float(second), IDLE, NOTHING)
    assert len(timeline.samples) == HISTORY_S == 15 * 60
    assert timeline.samples[0].t == 10.0


@pytest.mark.parametrize(("status", "kind"), [(200, None), (400, "400"), (401, "400"), (413, "400"),
                                              (429, "429"), (529, "429"), (499, "aborted"), (500, "5xx"),
                                              (503, "5xx")])
def test_statuses_fall_into_the_dashboards_error_kinds(status, kind):
    assert error_kind(status) == kind


def test_recent_requests_hand_over_what_they_saw_once_and_keep_only_the_newest():
    recent = RecentRequests(capacity=3)
    for value in range(5):
        recent.ttft.append(float(value))
    recent.error(404, "/v1/nothing", "Not Found")
    recent.error(200, "/v1/models", "not an error")
    taken = recent.take()
    assert taken.ttft == [2.0, 3.0, 4.0]
    assert [(e.kind, e.status) for e in taken.errors] == [("400", 404)]
    assert recent.take() == NOTHING
