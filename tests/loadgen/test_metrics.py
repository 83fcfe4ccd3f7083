"""Golden values for the serving metrics."""

from __future__ import annotations

import random

import pytest

from loadgen.metrics import RequestRecord, summarize


def rec(index, arrival, token_times, output_tokens=None):
    return RequestRecord(index=index, arrival_s=arrival, token_times_s=list(token_times), status=200,
                         output_tokens=output_tokens if output_tokens is not None else len(token_times))


def test_ttft_and_itls():
    r = rec(0, 0.0, [0.320, 0.355, 0.392, 0.428])
    assert r.ttft_ms == pytest.approx(320)
    assert r.itls_ms == pytest.approx([35, 37, 36])


def test_tpot():
    r = rec(0, 0.0, [0.2, 2.2], output_tokens=50)  # TTFT 200 ms, E2E 2,200 ms, 50 tokens
    assert r.tpot_ms == pytest.approx(2000 / 49) and round(r.tpot_ms, 1) == 40.8


def test_mean_tpot_differs_from_pooled_itl():
    a = rec(0, 0.0, [0.1 + 0.03 * i for i in range(10)])
    b = rec(1, 0.0, [0.1 + 0.05 * i for i in range(1000)])
    s = summarize([a, b], duration_s=60, slo_ttft_ms=None, slo_tpot_ms=None)
    assert s["tpot_ms"]["mean"] == pytest.approx(40)
    assert s["itl_ms"]["mean"] == pytest.approx(49.8, abs=0.05)


def test_attainment_of_a_synthetic_mix():
    rng = random.Random(0)
    records = []
    for i in range(2000):
        slow = i % 10 == 0
        ttft = rng.uniform(800, 5000) if slow else rng.uniform(100, 300)
        tpot = rng.uniform(100, 300) if slow else rng.uniform(30, 80)
        records.append(rec(i, 0.0, [ttft / 1e3, (ttft + 9 * tpot) / 1e3], output_tokens=10))
    s = summarize(records, duration_s=100, slo_ttft_ms=500, slo_tpot_ms=100)
    assert s["slo_attainment"] == pytest.approx(0.9, abs=1e-9)
    assert s["goodput_rps"] == pytest.approx(18.0)


def test_errors_never_count_as_good():
    bad = RequestRecord(index=0, arrival_s=0, status=503, error="http 503: busy")
    s = summarize([bad, rec(1, 0, [0.1, 0.2])], duration_s=1, slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert s["num_errors"] == 1 and s["errors_by_kind"] == {"http 503": 1}
    assert s["slo_attainment"] == 0.5
