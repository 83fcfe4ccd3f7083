"""What Prometheus reads from the routers (real HTTP, Redis, engines): scraping two routers gives each worker
series once, and every metric the chart's Grafana dashboard and alert rules query is exported."""

from __future__ import annotations

import json
import re

import httpx
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.worker_client import LocalWorkerClient
from tests.helm.chart import CHART
from tests.router.conftest import MODEL
from tests.router.serve import serve_router
from workers.protocol.cluster_keys import ROLES, ClusterKeys, PoolTarget
from workers.protocol.messages import pack


def _series(text: str) -> list[str]:
    """Every sample of a scrape as 'name{sorted labels}'."""
    return [f"{s.name}{sorted(s.labels.items())}" for f in text_string_to_metric_families(text) for s in f.samples]


def _families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def _queried_metrics() -> set[str]:
    """The metric names the dashboard's panels and the alert rules query, without histogram/counter suffixes."""
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [rule["expr"] for rule in yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())]
    names = {n for e in exprs for n in re.findall(r"\btandem_[a-z_]+", e)}
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}


def test_two_routers_export_each_worker_series_once_and_all_the_dashboard_needs(local_cluster, redis_url):
    router, prefill, decode = local_cluster
    config = router.app.state.router.config
    # The pools' targets, as tandem serve's controller keeps them.
    targets = {role: pack(PoolTarget(1, 1, 1)) for role in ROLES}
    redis.Redis.from_url(redis_url).hset(ClusterKeys(config.cluster).pool_targets, mapping=targets)
    other = serve_router(config, LocalWorkerClient({"d0": decode}, {"p0": prefill}), decode.loop.engine.tokenizer,
                         min_workers=2)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
                "stream": True, "ignore_eos": True}
        for url in (router.url, other.url):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                assert any(line == "data: [DONE]" for line in response.iter_lines())
        scrapes = [httpx.get(f"{url}/metrics", timeout=10).text for url in (router.url, other.url)]
        worker_series = [s for text in scrapes for s in _series(text) if "'worker_id'" in s]
        assert worker_series, "no worker series in either scrape"
        assert {s.split("[")[0] for s in worker_series} >= {"tandem_requests_finished_total", "tandem_kv_usage_ratio"}
        duplicated = sorted({s for s in worker_series if worker_series.count(s) > 1})
        assert not duplicated, duplicated[:5]
        # Exactly one router exports them: the lease holder.
        exporters = [i for i, text in enumerate(scrapes) if "worker_id=" in text]
        assert len(exporters) == 1
        # Each router's own series come from both (they are per router).
        for text in scrapes:
            assert 'tandem_router_ttft_seconds_count{model_name="' + MODEL + '"} 1.0' in text
        # Every name the dashboard and the alerts query is exported.
        exported = _families(scrapes[0]) | _families(scrapes[1])
        missing = sorted(_queried_metrics() - exported)
        assert not missing, missing
        # The holder leaves: the other router takes over at its next scrape.
        holder = [router, other][exporters[0]]
        holder.stop()  # its lifespan hands the lease back
        survivor = other if holder is router else router
        assert "worker_id=" in httpx.get(f"{survivor.url}/metrics", timeout=10).text
    finally:
        other.stop()
