"""What the prefill and decode services share: one engine on its loop thread, the worker's KV
transport (with the engine's cache registered), its metrics, its load report, and draining.

Draining (a pool shrinking): leave the registry first so routers stop sending work, wait a grace
period for requests routed before every router noticed, let the in-flight requests finish, then stop.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

from workers.engine.engine import Engine, RequestOutput, StepResult
from workers.engine.scheduler import KVReservation
from workers.protocol.cluster_keys import ClusterKeys, WorkerInfo
from workers.protocol.errors import QueueTimeoutError, WorkerStopped
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


class EngineService(ABC):
    """Owns the engine (through its loop thread), the transport, the publisher and the metrics.

    Nothing runs until ``start()``: it starts the engine thread, then the publisher (which registers
    the worker in Redis, so routers send work only once the engine steps).
    """

    role: str

    def __init__(self, engine: Engine, transport: KVTransport, worker_id: str, publish: PublishConfig | None = None,
                 engine_threads: int | None = None):
        self.worker_id = worker_id
        self.transport = transport
        transport.register(engine.runner.kv_cache)
        self.metrics = WorkerMetrics(worker_id, self.role)
        self.num_requests_started = 0  # subclasses count each request they take
        self._closed = False
        self.publisher: WorkerPublisher | None = None
        self.loop = EngineLoop(engine, self._on_step, self._on_fatal, name=f"{worker_id}-engine",
                               num_threads=engine_threads, compute_starts=self._compute_starts)
        if publish is not None:
            info = WorkerInfo(worker_id, self.role, publish.ray_namespace, engine.block_pool.block_size,
                              engine.block_pool.num_blocks, engine.max_model_len)
            self.publisher = WorkerPublisher(
                publish.redis_url, ClusterKeys(publish.cluster), info, self._read_load, self._queue_snapshot,
                publish.interval_s, publish.snapshot_interval_s)

    def start(self) -> Self:
        """Start stepping and publishing; returns the service, so ``Service(...).start()`` reads as one."""
        self.loop.start()
        if self.publisher is not None:
            self.publisher.start()
        return self

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

    def _queue_snapshot(self) -> None:
        """Publisher thread: the engine thread queues its cache behind the events of every step so far."""
        def queue(engine: Engine) -> None:
            if self.publisher is not None:
                self.publisher.submit_snapshot(self._load_of(engine), engine.block_pool.cached_chains())

        self.loop.call(queue).result(timeout=5.0)

    @abstractmethod
    def num_in_flight(self) -> int:
        """Requests this worker still holds (streams, pending prefills, transfers)."""

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
    def _on_step(self, engine: Engine, result: StepResult, seconds: float) -> None:
        publisher = self.publisher
        if publisher is not None:
            publisher.submit(result.kv_events)
        if result.num_tokens:
            self.metrics.observe_step(seconds, result.is_decode_only)
            self.metrics.update(engine.stats())
        for waited in result.queue_seconds:
            self.metrics.queue_seconds.observe(waited)
        for request_id, waited in result.shed:
            self._on_request_failed(request_id, QueueTimeoutError(
                f"no room on {self.worker_id} after {waited:.1f} s in its queue (max_queue_time_s); try again "
                "shortly"))
        if result.reservations:
            self._on_reservations(result.reservations)
        if result.outputs:
            self._on_outputs(engine, result.outputs)

    def _compute_starts(self) -> None:
        """A step's layers start: hand over what waits on the engine thread (workers/model/compute_starts.py)."""
        return None  # a prefill worker's results go out by themselves

    @abstractmethod
    def _on_reservations(self, reservations: list[KVReservation]) -> None:
        """Blocks reserved for remote prefills: the prefill worker can be asked to fill them now."""

    @abstractmethod
    def _on_outputs(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Tokens of one step, on the engine thread: hand them to whoever waits for them."""

    @abstractmethod
    def _on_request_failed(self, request_id: str, error: BaseException) -> None:
        """The engine dropped the request (shed): end it with ``error``. Any thread."""

    @abstractmethod
    def _on_fatal(self, error: BaseException) -> None:
        """The engine broke (or the worker stopped): end every request held with ``error``."""
