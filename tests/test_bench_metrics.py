"""The benchmark's arithmetic on hand-made event streams; expected values are worked out by hand."""

from __future__ import annotations

import pytest

from sluice.bench.dataset import BenchRequest, SyntheticSpec, fresh_prompts, synthetic
from sluice.bench.metrics import Distribution, RequestRecord, Slo, Spread, percentile, summarize


def _stream() -> RequestRecord:
    # Sent at 10.0 s; chunks of 1, 1, 2, 1 tokens at 10.20, 10.23, 10.33, 10.38; stream ends at 10.40.
    return RequestRecord(
        sent_at=10.0,
        done_at=10.40,
        chunk_times=(10.20, 10.23, 10.33, 10.38),
        chunk_tokens=(1, 1, 2, 1),
        prompt_tokens=7,
        output_tokens=5,
    )


def _simple(sent_at: float, first: float, done: float, output_tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        sent_at=sent_at, done_at=done, chunk_times=(first, done), chunk_tokens=(1, output_tokens - 1),
        prompt_tokens=10, output_tokens=output_tokens, error=error,
    )


def test_ttft_is_first_token_chunk_minus_send_time() -> None:
    assert _stream().ttft == pytest.approx(0.200)


def test_e2e_is_stream_end_minus_send_time() -> None:
    assert _stream().e2e == pytest.approx(0.400)


def test_tpot_spreads_time_after_first_token_over_remaining_tokens() -> None:
    # (400 ms - 200 ms) / (5 - 1)
    assert _stream().tpot == pytest.approx(0.050)


def test_tpot_is_undefined_for_a_single_token_output() -> None:
    one = RequestRecord(sent_at=0.0, done_at=0.3, chunk_times=(0.3,), chunk_tokens=(1,), prompt_tokens=3, output_tokens=1)
    assert one.tpot is None


def test_itl_splits_a_multi_token_chunk_gap_evenly_over_its_tokens() -> None:
    # Gaps 30 ms (1 token), 100 ms (2 tokens -> 50, 50), 50 ms (1 token).
    assert _stream().itls() == pytest.approx([0.030, 0.050, 0.050, 0.050])


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)


def test_distribution_reports_milliseconds() -> None:
    d = Distribution.of_seconds([0.001, 0.002, 0.003, 0.004])
    assert (d.mean, d.median, d.p90, d.p99) == pytest.approx((2.5, 2.5, 3.7, 3.97))


def test_slo_rejects_a_request_over_either_bound() -> None:
    slo = Slo(ttft_ms=250, tpot_ms=40)
    assert not slo.met_by(_stream())  # TPOT 50 ms > 40 ms
    assert Slo(ttft_ms=250, tpot_ms=60).met_by(_stream())
    assert not Slo(ttft_ms=150).met_by(_stream())


def test_summary_counts_throughput_over_completed_requests_and_goodput_under_slo() -> None:
    records = [
        _simple(sent_at=0.0, first=0.1, done=1.1, output_tokens=11),  # TTFT 100 ms, TPOT 100 ms
        _simple(sent_at=0.5, first=0.8, done=1.8, output_tokens=6),  # TTFT 300 ms, TPOT 200 ms
        RequestRecord(sent_at=1.0, done_at=1.2, chunk_times=(), chunk_tokens=(), prompt_tokens=0,
                      output_tokens=0, error="HTTP 500"),
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=250))
    assert (s.completed, s.failed) == (2, 1)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(17 / 2.0)
    assert s.total_token_throughput == pytest.approx((20 + 17) / 2.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.tpot_ms.mean == pytest.approx(150.0)
    assert s.e2e_ms.median == pytest.approx(1200.0)  # 1100 and 1300 ms
    assert s.good_requests == 1
    assert s.goodput == pytest.approx(0.5)
    # Two requests decoding for 1.0 s each during a 2 s run: one request decoding on average.
    assert s.mean_decode_batch == pytest.approx(1.0)


def test_fresh_prompts_keep_lengths_and_outputs_but_not_token_ids() -> None:
    requests = synthetic(SyntheticSpec(num_requests=6, seed=3)) + [BenchRequest("a text prompt", 5)]
    fresh = fresh_prompts(requests, salt=1)
    assert [(len(r.prompt), r.output_tokens) for r in fresh] == [(len(r.prompt), r.output_tokens) for r in requests]
    assert all(f.prompt != r.prompt for f, r in zip(fresh[:-1], requests[:-1]))
    assert fresh[-1] == requests[-1]  # text prompts are replayed as they are
    assert fresh == fresh_prompts(requests, salt=1) and fresh != fresh_prompts(requests, salt=2)


def test_spread_is_the_median_and_range_of_repeated_runs() -> None:
    assert Spread.of([358.3, 350.1, 360.2]) == Spread(median=358.3, min=350.1, max=360.2)
    assert Spread.of([1.0, 4.0]).median == pytest.approx(2.5)


def test_spread_formats_median_then_range_with_the_spec_applied_to_each() -> None:
    assert f"{Spread(358.27, 350.1, 360.24):.1f}" == "358.3 (350.1-360.2)"
    assert f"{Spread(112.4, 104.0, 131.0):.0f}" == "112 (104-131)"
