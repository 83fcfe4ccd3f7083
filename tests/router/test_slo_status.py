"""What a router observes of the SLO reaches ``/cluster/status``, ``/metrics`` and Redis (real HTTP, Redis)."""

from __future__ import annotations

import time

import httpx
import redis

from router.slo_report import SLOReport, fresh_reports
from tests.router.conftest import MODEL
from workers.protocol.cluster_keys import ClusterKeys
from workers.protocol.messages import unpack


def test_served_requests_reach_the_window_the_metrics_and_redis(local_cluster, redis_url):
    router, _, _ = local_cluster
    state = router.app.state.router
    before = state.slo.totals()
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    for stream in (False, True):
        response = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 200
    bad = httpx.post(f"{router.url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400  # a bad request is the client's: no SLO counts it
    after = state.slo.totals()
    assert (after.arrived - before.arrived, after.finished - before.finished) == (2, 2)
    assert after.output_tokens - before.output_tokens == 12 and after.tpot_count - before.tpot_count == 2
    assert after.met - before.met == 2  # a tiny model, an idle cluster: well within 2 s / 200 ms

    status = httpx.get(f"{router.url}/cluster/status", timeout=10).json()
    slo = status["slo"]
    assert (slo["ttft_ms"], slo["tpot_ms"]) == (2000.0, 200.0)
    assert slo["router"]["finished"] >= 2 and slo["router"]["attainment"] == 1.0
    assert slo["router"]["mean_ttft_ms"] > 0 and slo["router"]["mean_queue_ms"] is not None
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert "tandem_router_slo_attainment 1.0" in metrics
    assert "tandem_router_tpot_seconds_count" in metrics and "tandem_router_queue_seconds_count" in metrics

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 5
    while True:  # published every second
        stored = client.hgetall(ClusterKeys(state.config.cluster).slo)
        reports = fresh_reports(stored, time.time())
        if reports and reports[0].totals.finished >= after.finished:
            break
        assert time.monotonic() < deadline, stored
        time.sleep(0.2)
    assert [r.router_id for r in reports] == [state.router_id]
    assert unpack(SLOReport, stored[state.router_id.encode()]).window.met >= 2
    assert status["slo"]["cluster"]["routers"] == 1
