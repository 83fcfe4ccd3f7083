"""One interval of the whole cluster, read from Redis: what the autoscaler decides on.

    observer = ClusterObserver(redis_client, ClusterKeys("default"))
    observation = observer.observe()    # since the previous call

Routers publish their SLO totals since they started (``router.slo_report``); the difference between two
reads of a router is its share of the interval, and the shares add up. A router seen for the first time
counts from its start; one that restarted (new start time) too. Workers' load reports give the
requests waiting now and the live pools.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import redis

from cluster.autoscaler import Observation
from router.slo_report import SLOReport, fresh_reports
from router.slo_window import SLOCounts
from workers.protocol.cluster_keys import ROLES, ClusterKeys, WorkerInfo
from workers.protocol.messages import WorkerLoad, unpack


class ClusterObserver:
    def __init__(self, client: redis.Redis, keys: ClusterKeys):
        self.redis = client
        self.keys = keys
        self._last: dict[str, SLOReport] = {}
        self._last_at = time.time()

    def observe(self) -> Observation:
        now = time.time()
        reports = fresh_reports(self.redis.hgetall(self.keys.slo), now)  # type: ignore[arg-type]
        parts = [_difference(r.totals, self._previous(r)) for r in reports]
        counts = replace(SLOCounts.merge(parts), span_s=now - self._last_at)
        self._last = {r.router_id: r for r in reports}
        self._last_at = now
        waiting, live = self._workers()
        return Observation(counts, waiting, live)

    def _previous(self, report: SLOReport) -> SLOCounts:
        last = self._last.get(report.router_id)
        if last is None or last.started_at != report.started_at:
            return SLOCounts(0.0)
        return last.totals

    def _workers(self) -> tuple[int, dict[str, int]]:
        registry: dict[bytes, bytes] = self.redis.hgetall(self.keys.registry)  # type: ignore[assignment]
        infos = [unpack(WorkerInfo, v) for v in registry.values()]
        loads: list[bytes | None] = self.redis.mget([self.keys.load(i.worker_id) for i in infos]) if infos else []  # type: ignore[assignment]
        live = dict.fromkeys(ROLES, 0)
        waiting = 0
        for info, data in zip(infos, loads, strict=True):
            if data is None:
                continue  # its heartbeat lapsed: not serving
            load = unpack(WorkerLoad, data)
            live[info.role] += 1
            waiting += load.num_waiting
        return waiting, live


def _difference(now: SLOCounts, before: SLOCounts) -> SLOCounts:
    return SLOCounts(0.0, **{f.name: getattr(now, f.name) - getattr(before, f.name)
                             for f in fields(SLOCounts) if f.name != "span_s"})
