"""Each router's SLO figures in Redis, so that the autoscaler and any router see the whole cluster.

    tandem:<cluster>:slo   hash   router id -> msgpack SLOReport (rewritten every ``interval_s``)

A report carries the router's window and its totals since it started (plain sums: several routers'
add up). Readers skip reports older than ``stale_after_s`` (a router that went away).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from router.slo_window import SLOCounts, SLOWindow
from workers.protocol.cluster_keys import ClusterKeys
from workers.protocol.messages import pack, unpack

log = logging.getLogger(__name__)

STALE_AFTER_S = 10.0


@dataclass
class SLOReport:
    router_id: str
    at: float  # Unix time of the report
    started_at: float  # Unix time the router's totals began (a new router: new totals)
    window: SLOCounts
    totals: SLOCounts


def report_of(router_id: str, window: SLOWindow, started_at: float) -> SLOReport:
    return SLOReport(router_id, time.time(), started_at, window.counts(), window.totals())


def fresh_reports(stored: dict[bytes, bytes], now: float, stale_after_s: float = STALE_AFTER_S) -> list[SLOReport]:
    """The reports of routers that reported lately (a bad entry is skipped, not fatal)."""
    reports = []
    for data in stored.values():
        try:
            report = unpack(SLOReport, data)
        except (ValueError, TypeError):
            continue
        if now - report.at <= stale_after_s:
            reports.append(report)
    return reports


async def report_loop(redis: aioredis.Redis, keys: ClusterKeys, router_id: str, window: SLOWindow,
                      interval_s: float = 1.0) -> None:
    """Publish this router's report every ``interval_s`` until cancelled; Redis outages are waited out."""
    started_at = time.time()
    while True:
        try:
            await redis.hset(keys.slo, router_id, pack(report_of(router_id, window, started_at)))
        except aioredis.RedisError as e:
            log.debug("SLO report not written: %s", e)
        await asyncio.sleep(interval_s)


async def cluster_window(redis: aioredis.Redis, keys: ClusterKeys) -> tuple[SLOCounts, int]:
    """Every live router's window, merged, and how many routers reported."""
    reports = fresh_reports(await redis.hgetall(keys.slo), time.time())  # type: ignore[arg-type]
    return SLOCounts.merge(r.window for r in reports), len(reports)
