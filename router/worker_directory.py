"""The router's list of live workers and their load, polled from Redis (the workers' registry and
load reports; a report's TTL is the worker's heartbeat, so a worker that stops leaves routing when
its key expires, within the TTL).

Worker ids join ``PrefixIndex`` tags and dispatch; the directory says which of them may be chosen.

A Redis that lost its data (restarted without persistence, flushed) shows an empty registry until each
worker notices at its next load report and registers again (a report interval, 0.1 s by default). Read
as "every worker left", that would be a burst of 503s; the directory keeps a mark key of its own in
Redis, and when the mark is gone it keeps its last view for ``data_loss_grace_s`` while workers return.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from router.task_stop import cancel_and_wait
from workers.protocol.cluster_keys import ClusterKeys, WorkerInfo
from workers.protocol.messages import WorkerLoad, unpack

log = logging.getLogger(__name__)


@dataclass
class WorkerEntry:
    info: WorkerInfo
    load: WorkerLoad
    seen_at: float  # monotonic time of the last report read


class WorkerDirectory:
    def __init__(self, redis: aioredis.Redis, keys: ClusterKeys, poll_interval_s: float = 0.05,
                 data_loss_grace_s: float = 5.0):
        self.redis = redis
        self.keys = keys
        self.poll_interval_s = poll_interval_s
        # A worker's load TTL: by then every live worker has reported, and so registered again.
        self.data_loss_grace_s = data_loss_grace_s
        self.workers: dict[str, WorkerEntry] = {}
        self.last_poll_ok = False
        self._mark = keys.data_mark(uuid.uuid4().hex[:12])
        self._marked = False  # set once this directory has written its mark
        self._data_lost_at: float | None = None
        # Called with the ids of workers that left (the prefix index drops their tags).
        self.on_removed: list[Callable[[list[str]], None]] = []
        self._task: asyncio.Task[None] | None = None

    def live(self, role: str) -> list[WorkerEntry]:
        return [e for e in self.workers.values() if e.info.role == role]

    def event_positions(self) -> dict[str, tuple[int, int]]:
        """Each live worker's KV event stream position, as its last load report gave it."""
        return {w: (e.load.kv_events_epoch, e.load.kv_events_seq) for w, e in self.workers.items()}

    async def start(self) -> None:
        await self.poll()
        self._task = asyncio.create_task(self._run(), name="worker-directory")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        try:
            await self.redis.delete(self._mark)
        except (aioredis.RedisError, OSError):
            pass  # it expires by itself

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll()
            except (aioredis.RedisError, OSError) as e:
                if self.last_poll_ok:
                    log.warning("worker directory: Redis unreachable (%s); keeping the last view", e)
                self.last_poll_ok = False

    async def poll(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.registry)
        pipe.exists(self._mark)
        # Outlives any stall of this router's; a stall longer than that only costs a grace period.
        pipe.set(self._mark, 1, px=600_000)
        registry: dict[bytes, bytes]
        registry, mark_found, _ = await pipe.execute()
        now = time.monotonic()
        if self._marked and not mark_found:
            log.warning("worker directory: Redis lost its data (restarted or flushed); keeping the last view "
                        "for up to %.1f s while workers register again", self.data_loss_grace_s)
            self._data_lost_at = now
        self._marked = True
        ids = [k.decode() for k in registry]
        loads: list[bytes | None] = await self.redis.mget(  # type: ignore[assignment]
            [self.keys.load(w) for w in ids]) if ids else []
        fresh: dict[str, WorkerEntry] = {}
        for (raw_id, raw_info), raw_load in zip(registry.items(), loads, strict=True):
            if raw_load is None:
                continue  # registered but silent: dead or not started yet
            try:
                info = unpack(WorkerInfo, raw_info)
                fresh[raw_id.decode()] = WorkerEntry(info, unpack(WorkerLoad, raw_load), now)
            except (TypeError, ValueError) as e:
                log.warning("worker directory: ignoring worker %s with a bad record: %s", raw_id, e)
        if self._data_lost_at is not None:
            if now - self._data_lost_at < self.data_loss_grace_s:
                fresh = {**{w: e for w, e in self.workers.items() if w not in fresh}, **fresh}
            else:
                self._data_lost_at = None
        gone = [w for w in self.workers if w not in fresh]
        self.workers = fresh
        self.last_poll_ok = True
        if gone:
            log.info("workers left routing: %s", ", ".join(gone))
            for callback in self.on_removed:
                callback(gone)
