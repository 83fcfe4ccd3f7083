"""A worker's voice in Redis: its registration, a load report every ``interval_s`` (which doubles
as the heartbeat: the key expires when the worker stops), and its KV events as a stream.

    engine thread --submit(events) / submit_snapshot(...)--> queue --> publisher thread --XADD / SET--> Redis

Each stream entry carries the publisher's ``epoch`` (new at every start and after every Redis
outage) and a ``seq`` that grows by one per entry, so a router can tell a gap (trimmed stream,
lost connection) and reload the snapshot, which is rewritten every ``snapshot_interval_s``.

A snapshot travels through the same queue as the events, so it is written at the ``seq`` of exactly
the steps before it. It shows the cache as it is, which may include changes made between two steps
(a commit, an abort) whose events come with the next step, after the snapshot: replaying them is
harmless, since each event sets blocks present or absent and the last event for a block wins.
Redis being down never stops the worker: the publisher logs, retries, and resyncs with a new epoch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgpack
import redis

from workers.protocol.cluster_keys import ClusterKeys, KVSnapshot, WorkerInfo
from workers.protocol.kv_events import AllBlocksCleared, KVEvent, encode_events
from workers.protocol.messages import WorkerLoad, pack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishConfig:
    """Where a worker publishes (``None`` in place of one: a worker nobody routes to by Redis, e.g. tests)."""

    redis_url: str
    cluster: str = "default"
    ray_namespace: str | None = None
    interval_s: float = 0.1
    snapshot_interval_s: float = 5.0


@dataclass(frozen=True)
class CacheSnapshot:
    """The load and every cached block as (hash, parent), read on the engine thread between two steps."""

    load: WorkerLoad
    blocks: list[tuple[int, int | None]]


# Asks the engine thread to queue a CacheSnapshot (``submit_snapshot``) and waits until it has.
SnapshotFn = Callable[[], None]
LoadFn = Callable[[], WorkerLoad]


class WorkerPublisher:
    def __init__(self, redis_url: str, keys: ClusterKeys, info: WorkerInfo, read_load: LoadFn,
                 read_snapshot: SnapshotFn, interval_s: float = 0.1, snapshot_interval_s: float = 5.0,
                 load_ttl_s: float = 5.0, stream_maxlen: int = 10_000):
        self.keys = keys
        self.info = info
        self.interval_s = interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self.load_ttl_ms = int(load_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self._read_load = read_load
        self._read_snapshot = read_snapshot
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._queue: queue.SimpleQueue[list[KVEvent] | CacheSnapshot] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._epoch = 0
        self._seq = 0
        self._last_id = "0-0"
        self._in_sync = False
        self._thread = threading.Thread(target=self._run, name=f"{info.worker_id}-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, events: list[KVEvent]) -> None:
        """Engine thread: queue one step's events (cheap; never touches the network)."""
        if events:
            self._queue.put(events)

    def submit_snapshot(self, load: WorkerLoad, blocks: list[tuple[int, int | None]]) -> None:
        """Engine thread: queue the cache as it is now, behind the events of every step so far."""
        self._queue.put(CacheSnapshot(load, blocks))

    def close(self) -> None:
        """Stop publishing and leave the registry at once (routers stop routing here); the worker's
        keys go with it so nothing is left behind in Redis."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        worker = self.info.worker_id
        try:
            self._redis.hdel(self.keys.registry, worker)
            self._redis.delete(self.keys.load(worker), self.keys.kv_stream(worker), self.keys.kv_snapshot(worker))
        except redis.RedisError:
            pass  # the load key expires by itself
        self._redis.close()

    # ---- publisher thread ----
    def _run(self) -> None:
        next_load = next_snapshot = 0.0
        while not self._stop.is_set():
            try:
                if not self._in_sync:
                    self._resync()  # its snapshot reports the load too
                    next_snapshot = time.monotonic() + self.snapshot_interval_s
                    next_load = time.monotonic() + self.interval_s
                self._pump(timeout_s=max(0.0, next_load - time.monotonic()))
                now = time.monotonic()
                if now >= next_snapshot:
                    self._snapshot()  # reports the load as well
                    next_snapshot = now + self.snapshot_interval_s
                    next_load = now + self.interval_s
                if now >= next_load:
                    next_load = now + self.interval_s
                    self._report_load(self._read_load())
            except concurrent.futures.TimeoutError:
                pass  # the engine is inside a long step; report at the next tick
            except (redis.RedisError, OSError) as e:
                if self._in_sync:
                    log.warning("%s: Redis unreachable (%s); retrying", self.info.worker_id, e)
                self._in_sync = False
                self._stop.wait(1.0)
            except Exception:  # noqa: BLE001 - e.g. the engine stopped; publishing is best effort
                log.exception("%s: publishing failed", self.info.worker_id)
                self._stop.wait(1.0)

    def _pump(self, timeout_s: float) -> None:
        """Publish what the engine queued, in its order (waiting up to ``timeout_s`` for the first item):
        events as one stream entry, each snapshot at the seq of the events queued before it."""
        events: list[KVEvent] = []
        try:
            item = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
            while True:
                if isinstance(item, CacheSnapshot):
                    self._publish(events)
                    events = []
                    self._write_snapshot(item)
                else:
                    events.extend(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        self._publish(events)

    def _publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        fields = {"epoch": self._epoch, "seq": self._seq + 1, "events": msgpack.packb(encode_events(events))}
        stream_id = self._redis.xadd(self.keys.kv_stream(self.info.worker_id), fields,  # type: ignore[arg-type]
                                     maxlen=self.stream_maxlen, approximate=True)
        self._seq += 1
        self._last_id = stream_id.decode() if isinstance(stream_id, bytes) else str(stream_id)

    def _snapshot(self) -> None:
        """Have the engine queue a snapshot behind its events, then publish up to and including it."""
        self._read_snapshot()
        self._pump(timeout_s=0.0)

    def _write_snapshot(self, snapshot: CacheSnapshot) -> None:
        snap = KVSnapshot(self._epoch, self._seq, self._last_id, [[h, p] for h, p in snapshot.blocks])
        self._redis.set(self.keys.kv_snapshot(self.info.worker_id), pack(snap))
        self._report_load(snapshot.load)

    def _resync(self) -> None:
        """A new epoch: register, restart the stream with ``AllBlocksCleared``, write a snapshot."""
        self._epoch = random.getrandbits(62)
        self._seq = 0
        self._redis.hset(self.keys.registry, self.info.worker_id, pack(self.info))
        self._publish([AllBlocksCleared()])
        self._snapshot()
        self._in_sync = True

    def _report_load(self, load: WorkerLoad) -> None:
        """The load, and a check that Redis still has this worker registered: a Redis restarted or flushed
        between two reports (redis-py reconnects silently) lost the registry, the KV stream and the snapshot,
        so the worker starts over (a new epoch: register, clear, snapshot) and routers rebuild from that."""
        load = replace(load, kv_events_epoch=self._epoch, kv_events_seq=self._seq)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self.keys.load(self.info.worker_id), pack(load), px=self.load_ttl_ms)
        pipe.hsetnx(self.keys.registry, self.info.worker_id, pack(self.info))
        _, was_missing = pipe.execute()
        if was_missing and self._in_sync:
            log.warning("%s: Redis lost this worker's registration (restarted or flushed); starting over",
                        self.info.worker_id)
            self._in_sync = False
