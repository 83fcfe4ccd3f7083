"""What the prefill and decode services share: one engine on its loop thread, the worker's KV
transport (with the engine's cache registered), its metrics, and its load report."""

from __future__ import annotations

from collections.abc import Callable

from workers.cluster_keys import ClusterKeys, WorkerInfo
from workers.engine import Engine, KVReservation, RequestOutput
from workers.engine_loop import EngineLoop
from workers.kv_events import KVEvent
from workers.kv_transport import KVTransport
from workers.metrics import WorkerMetrics
from workers.protocol import WorkerLoad
from workers.publisher import PublishConfig, WorkerPublisher


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

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.loop.stop()
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
