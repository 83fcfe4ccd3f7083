"""Feeds the prefix index from the workers' KV event streams in Redis.

For each live worker: load its snapshot (the cache at some ``seq``), then read its stream from
that point with one blocking XREAD over all streams. An entry whose ``epoch`` differs or whose
``seq`` is not the next one (the worker restarted, the stream was trimmed past us) means the index
may be wrong for that worker: drop its tags and reload the snapshot. Entries lost while the worker
then goes quiet leave no later entry to show the gap, so the stream position each load report
carries is compared too: a router behind it for longer than ``behind_grace_s`` resyncs. Every router replica applies
the same entries in the same order, so their exact indexes are identical.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis

from router.prefix_index import PrefixIndex
from workers.protocol.cluster_keys import ClusterKeys, KVSnapshot
from workers.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_events
from workers.protocol.messages import unpack

log = logging.getLogger(__name__)


@dataclass
class _StreamState:
    epoch: int
    seq: int
    last_id: str


def apply_events(index: PrefixIndex, worker_id: str, events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.apply_stored(worker_id, event.block_hashes, event.parent_hash)
        elif isinstance(event, BlockRemoved):
            index.apply_removed(worker_id, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear_worker(worker_id)


class KVEventConsumer:
    def __init__(self, redis: aioredis.Redis, keys: ClusterKeys, index: PrefixIndex, block_ms: int = 100,
                 behind_grace_s: float = 1.0):
        self.redis = redis
        self.keys = keys
        self.index = index
        self.block_ms = block_ms
        self.behind_grace_s = behind_grace_s
        self._streams: dict[str, _StreamState] = {}
        self._behind_since: dict[str, float] = {}
        self.num_events_applied = 0
        self.num_resyncs = 0

    def forget(self, worker_ids: list[str]) -> None:
        """Workers that left: their tags go, and a return starts from their snapshot."""
        for worker_id in worker_ids:
            self._streams.pop(worker_id, None)
            self.index.clear_worker(worker_id)

    async def sync(self, positions: dict[str, tuple[int, int]], block_ms: int | None = None) -> None:
        """One round over the live workers (id -> the (epoch, seq) their last load report gave):
        load snapshots of new workers, apply whatever their streams hold, resync those left behind."""
        for worker_id in positions:
            if worker_id not in self._streams:
                await self._load_snapshot(worker_id)
        if self._streams:
            await self._read(block_ms)
        elif block_ms:
            await asyncio.sleep(block_ms / 1000)
        await self._resync_if_behind(positions)

    async def run(self, live_positions: Callable[[], dict[str, tuple[int, int]]]) -> None:
        while True:
            try:
                await self.sync(live_positions(), self.block_ms)
            except (aioredis.RedisError, OSError) as e:
                log.warning("KV events: Redis unreachable (%s); retrying", e)
                await asyncio.sleep(1.0)

    async def _resync_if_behind(self, positions: dict[str, tuple[int, int]]) -> None:
        now = time.monotonic()
        for worker_id, (epoch, seq) in positions.items():
            state = self._streams.get(worker_id)
            if state is None or (epoch == state.epoch and seq <= state.seq) or epoch == 0:
                self._behind_since.pop(worker_id, None)
                continue
            since = self._behind_since.setdefault(worker_id, now)
            if now - since >= self.behind_grace_s:
                self.num_resyncs += 1
                log.info("KV events of %s: at %s/%s, the worker reports %s/%s; reloading its snapshot",
                         worker_id, state.epoch, state.seq, epoch, seq)
                del self._behind_since[worker_id]
                await self._load_snapshot(worker_id)

    async def _load_snapshot(self, worker_id: str) -> None:
        raw: bytes | None = await self.redis.get(self.keys.kv_snapshot(worker_id))  # type: ignore[assignment]
        self.index.clear_worker(worker_id)
        if raw is None:  # no snapshot yet: the stream from its start is the whole story
            self._streams[worker_id] = _StreamState(epoch=-1, seq=0, last_id="0-0")
            return
        snap = unpack(KVSnapshot, raw)
        for block_hash, parent_hash in snap.blocks:
            assert block_hash is not None
            self.index.apply_stored(worker_id, (block_hash,), parent_hash)
        self._streams[worker_id] = _StreamState(snap.epoch, snap.seq, snap.stream_id)

    async def _read(self, block_ms: int | None) -> None:
        streams = {self.keys.kv_stream(w): s.last_id for w, s in self._streams.items()}
        by_key = {self.keys.kv_stream(w): w for w in self._streams}
        replies: Any = await self.redis.xread(streams, count=1000, block=block_ms)  # type: ignore[arg-type]
        for key, entries in replies or ():
            worker_id = by_key.get(key.decode() if isinstance(key, bytes) else key)
            if worker_id is None:
                continue
            for entry_id, fields in entries:
                if not await self._apply_entry(worker_id, entry_id, fields):
                    break

    async def _apply_entry(self, worker_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> bool:
        """Apply one entry; False when it revealed a gap (the worker was resynced from its snapshot)."""
        state = self._streams.get(worker_id)
        if state is None:
            return False
        epoch, seq = int(fields[b"epoch"]), int(fields[b"seq"])
        # In order: the next entry of the same epoch, or the first entry of a new one (the worker
        # (re)started; that entry clears its tags).
        if not (seq == 1 or (epoch == state.epoch and seq == state.seq + 1)):
            self.num_resyncs += 1
            log.info("KV events of %s: gap (epoch %s seq %s after %s/%s); reloading its snapshot",
                     worker_id, epoch, seq, state.epoch, state.seq)
            await self._load_snapshot(worker_id)
            return False
        apply_events(self.index, worker_id, decode_events(msgpack.unpackb(fields[b"events"])))
        self.num_events_applied += 1
        state.epoch, state.seq, state.last_id = epoch, seq, entry_id.decode()
        return True
