"""What the prefill and decode services share: one engine on its loop thread, the worker's KV
transport (with the engine's cache registered), its metrics, its load report, and draining.

Draining (a pool shrinking): leave the registry first so routers stop sending work, wait a grace
period for requests routed before every router noticed, let the in-flight requests finish, then stop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.engine import Engine, KVReservation, RequestOutput
from workers.protocol.cluster_keys import ClusterKeys, WorkerInfo
from workers.protocol.errors import WorkerStopped
from workers.protocol.kv_events import KVEvent
from workers.protocol.messages import WorkerLoad
from workers.service.engine_loop import EngineLoop
from workers.service.metrics import WorkerMetrics
from workers.service.publisher import PublishConfig, WorkerPublisher
from workers.transport.base import KVTransport


@dataclass
class DrainReport:
    worker_id: str
    in_flight: int  # requests held when the worker began to leave routing
    arrived_after: int  # requests that arrived after that (routed before a router noticed)
    seconds: float
    unfinished: int  # still running at the drain timeout (stopped with the worker)


class EngineService:
    role: str

    def __init__(self, engine: Engine, transport: KVTransport, worker_id: str,
                 on_reservations: Callable[[list[KVReservation]], None] | None = None,
                 publish: PublishConfig | None = None):
        """Subclasses set up their own state first: the engine thread starts here."""
        self.worker_id = worker_id
        self.transport = transport
        transport.register(engine.runner.kv_cache)
        self.metrics = WorkerMetrics(worker_id, self.role)
        self.num_requests_started = 0  # subclasses count each request they take
        self._closed = False
        self.publisher: WorkerPublisher | None = None
        self.loop = EngineLoop(engine, self._on_outputs, on_reservations, self._on_step, self._on_fatal,
                               name=f"{worker_id}-engine")
        if publish is not None:
            info = WorkerInfo(worker_id, self.role, publish.ray_namespace, engine.block_pool.block_size,
                              engine.block_pool.num_blocks, engine.max_model_len)
            self.publisher = WorkerPublisher(
                publish.redis_url, ClusterKeys(publish.cluster), info, self._read_load, self._read_snapshot,
                publish.interval_s, publish.snapshot_interval_s)

    async def load(self) -> WorkerLoad:
        return await self.loop.run(self._load_of)

    def _load_of(self, engine: Engine) -> WorkerLoad:
        """Requests awaiting KV from a prefill worker count as running: they hold blocks and a batch slot."""
        stats = engine.stats()
        return WorkerLoad(self.worker_id, self.role, stats.num_waiting, stats.num_running + stats.num_awaiting_kv,
                          stats.kv_blocks_used, stats.kv_blocks_total, engine.num_queued_prefill_tokens(),
                          stats.prefix_hit_tokens_total)

    def _read_load(self) -> WorkerLoad:
        """Publisher thread: a load report, read on the engine thread between two steps (up to 1 s)."""
        return self.loop.call(self._load_of).result(timeout=1.0)

    def _read_snapshot(self) -> tuple[WorkerLoad, list[KVEvent], list[tuple[int, int | None]]]:
        return self.loop.call(
            lambda e: (self._load_of(e), e.take_kv_events(), e.block_pool.cached_chains())).result(timeout=5.0)

    def num_in_flight(self) -> int:
        """Requests this worker still holds (streams, pending prefills, transfers)."""
        raise NotImplementedError

    async def drain(self, grace_s: float = 1.0, timeout_s: float = 300.0) -> DrainReport:
        """Leave routing, finish what is in flight (up to ``timeout_s``), then stop the worker."""
        t0 = time.monotonic()
        # Counted before leaving: a request that arrives while the worker leaves was routed late.
        in_flight, started = self.num_in_flight(), self.num_requests_started
        await asyncio.to_thread(self._leave_routing)
        await asyncio.sleep(grace_s)
        while self.num_in_flight() and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.05)
        report = DrainReport(self.worker_id, in_flight, self.num_requests_started - started,
                             time.monotonic() - t0, self.num_in_flight())
        await asyncio.to_thread(self.close)
        return report

    def _leave_routing(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()

    def close(self) -> None:
        """Stop serving (a second call, e.g. shutdown after a drain, does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._leave_routing()
        self.loop.stop()
        if self.num_in_flight():  # they end with an error now rather than wait forever
            self._on_fatal(WorkerStopped(f"worker {self.worker_id} stopped while serving the request"))
        self.transport.close()

    # ---- engine thread ----
    def _on_step(self, engine: Engine, seconds: float) -> None:
        events = engine.take_kv_events()  # drained every step, published or not, so they never pile up
        if self.publisher is not None:
            self.publisher.submit(events)
        if engine.last_step_num_tokens:
            self.metrics.observe_step(seconds, engine.last_step_decode_only)
            self.metrics.update(engine.stats())

    def _on_outputs(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _on_fatal(self, error: BaseException) -> None:
        raise NotImplementedError
