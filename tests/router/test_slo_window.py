"""The SLO window: attainment, goodput and rates over a sliding window, totals, merging routers."""

from __future__ import annotations

import pytest

from router.slo_window import RequestTrace, SLOCounts, SLOTargets, SLOWindow, tpot_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_request_meets_only_within_both_targets_and_without_error():
    window = SLOWindow(SLOTargets(ttft_s=1.0, tpot_s=0.1), clock=Clock())
    assert window.finished(ttft_s=0.9, tpot_s=0.09, output_tokens=10, ok=True)
    assert not window.finished(ttft_s=1.1, tpot_s=0.05, output_tokens=10, ok=True)
    assert not window.finished(ttft_s=0.5, tpot_s=0.2, output_tokens=10, ok=True)
    assert not window.finished(ttft_s=0.5, tpot_s=0.05, output_tokens=10, ok=False)
    assert not window.finished(ttft_s=None, tpot_s=None, output_tokens=0, ok=False)  # refused: a miss
    assert window.finished(ttft_s=0.5, tpot_s=None, output_tokens=1, ok=True)  # one token: no TPOT to miss
    counts = window.counts()
    assert (counts.finished, counts.met, counts.attainment) == (6, 2, pytest.approx(2 / 6))
    assert counts.ttft_count == 5 and counts.tpot_count == 4


def test_rates_are_over_the_window_and_old_requests_leave_it():
    clock = Clock()
    window = SLOWindow(SLOTargets(1.0, 0.1), window_s=10.0, clock=clock)
    for _ in range(5):
        window.arrived(prompt_tokens=100)
        window.finished(ttft_s=0.1, tpot_s=0.01, output_tokens=20, ok=True)
        clock.now += 1.0
    counts = window.counts()  # 5 s into the window: rates over 5 s, not 10
    assert counts.span_s == 5.0 and counts.rate(counts.arrived) == pytest.approx(1.0)
    assert counts.goodput_rps == pytest.approx(1.0) and counts.rate(counts.output_tokens) == pytest.approx(20.0)
    clock.now += 7.5  # the first three are now older than 10 s
    counts = window.counts()
    assert (counts.arrived, counts.finished, counts.span_s) == (2, 2, 10.0)
    totals = window.totals()  # totals keep everything
    assert (totals.arrived, totals.met, totals.arrived_prompt_tokens, totals.span_s) == (5, 5, 500, 12.5)


def test_a_trace_records_ttft_and_tpot_from_its_times_and_a_bad_request_not_at_all():
    window = SLOWindow(SLOTargets(1.0, 0.1), clock=Clock())
    trace = RequestTrace(arrival=10.0, prompt_tokens=50, first_token_at=10.4, output_tokens=11, ok=True)
    tpot, met = window.record(trace, ended_at=11.4)
    assert tpot == pytest.approx(0.1) and met
    assert window.record(RequestTrace(arrival=10.0), ended_at=10.1) == (None, False)  # never valid
    assert window.counts().finished == 1
    assert tpot_seconds(0.5, 0.5, 1) is None


def test_counts_of_several_routers_add_up():
    a = SLOCounts(span_s=10.0, arrived=4, finished=4, met=3, ttft_sum_s=2.0, ttft_count=4)
    b = SLOCounts(span_s=8.0, arrived=6, finished=6, met=6, ttft_sum_s=1.0, ttft_count=6)
    merged = SLOCounts.merge([a, b])
    assert (merged.arrived, merged.met, merged.span_s) == (10, 9, 10.0)
    assert merged.attainment == pytest.approx(0.9) and merged.mean_ttft_s == pytest.approx(0.3)
    assert SLOCounts.merge([]).attainment is None
    summary = merged.summary()
    assert summary["goodput_rps"] == pytest.approx(0.9) and summary["mean_ttft_ms"] == 300.0
