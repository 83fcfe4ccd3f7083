"""What the prefill and decode services share: one engine on its loop thread, the worker's KV
transport (with the engine's cache registered), its metrics, and its load report."""

from __future__ import annotations

from collections.abc import Callable

from workers.engine import Engine, KVReservation, RequestOutput
from workers.engine_loop import EngineLoop
from workers.kv_transport import KVTransport
from workers.metrics import WorkerMetrics
from workers.protocol import WorkerLoad


class EngineService:
    role: str

    def __init__(self, engine: Engine, transport: KVTransport, worker_id: str,
                 on_reservations: Callable[[list[KVReservation]], None] | None = None):
        """Subclasses set up their own state first: the engine thread starts here."""
        self.worker_id = worker_id
        self.transport = transport
        transport.register(engine.runner.kv_cache)
        self.metrics = WorkerMetrics(worker_id, self.role)
        self.loop = EngineLoop(engine, self._on_outputs, on_reservations, self._on_step, self._on_fatal,
                               name=f"{worker_id}-engine")

    async def load(self) -> WorkerLoad:
        """Requests awaiting KV from a prefill worker count as running: they hold blocks and a batch slot."""
        stats = await self.loop.run(lambda e: e.stats())
        queued = await self.loop.run(lambda e: e.num_queued_prefill_tokens())
        return WorkerLoad(self.worker_id, self.role, stats.num_waiting, stats.num_running + stats.num_awaiting_kv,
                          stats.kv_blocks_used, stats.kv_blocks_total, queued, stats.prefix_hit_tokens_total)

    def close(self) -> None:
        self.loop.stop()
        self.transport.close()

    # ---- engine thread ----
    def _on_step(self, engine: Engine, seconds: float) -> None:
        self.metrics.observe_step(seconds, engine.last_step_decode_only)
        self.metrics.update(engine.stats())

    def _on_outputs(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _on_fatal(self, error: BaseException) -> None:
        raise NotImplementedError
