"""A prefill worker's logic, without Ray: compute prompts, send their KV, return the first token.

    result = await service.prefill(PrefillRequest(...))

Requests from many decode workers batch together in one engine (chunked, sharing the prefix cache).
When a prompt's first token is sampled its blocks stay held while a transfer thread writes them
into the decode worker's reserved blocks; then they are released and remain as evictable prefix
cache. Cancelling before the transfer aborts the prefill; during the transfer, the transfer runs
out (bounded by its timeout) so no write lands after the caller believes it is over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field

from workers.engine.engine import Engine, RequestOutput
from workers.engine.scheduler import KVReservation
from workers.protocol.errors import TandemError, TransferError, WorkerStopped, error_kind
from workers.protocol.messages import PrefillRequest, PrefillResult
from workers.service.base import EngineService
from workers.service.publisher import PublishConfig
from workers.transport.base import KVTransport


class PrefillCancelled(TandemError):
    """The caller cancelled the prefill."""


@dataclass
class _Pending:
    request: PrefillRequest
    result: concurrent.futures.Future[PrefillResult] = field(default_factory=concurrent.futures.Future)
    transferring: bool = False
    cancelled: bool = False


class PrefillService(EngineService):
    role = "prefill"

    def __init__(self, engine: Engine, transport: KVTransport, worker_id: str, max_concurrent_transfers: int = 4,
                 publish: PublishConfig | None = None, engine_threads: int | None = None):
        super().__init__(engine, transport, worker_id, publish, engine_threads)
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # _pending is shared by the asyncio, engine and transfer threads
        self._transfers = concurrent.futures.ThreadPoolExecutor(max_concurrent_transfers, f"{worker_id}-kv")

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        rid = request.request_id
        pending = _Pending(request)
        with self._lock:
            if self._closed:
                raise WorkerStopped(f"prefill worker {self.worker_id} has stopped")
            if rid in self._pending:
                raise TransferError(f"request {rid} is already being prefilled here")
            self._pending[rid] = pending
            self.num_requests_started += 1
        try:
            await self.loop.run(lambda e: e.add_request(
                request.prompt_token_ids, request.sampling, request_id=rid,
                cache_salt=request.cache_salt, prefill_only=True))
        except BaseException as e:
            self._finish(rid, exception=e)
        try:
            return await asyncio.wrap_future(pending.result)
        except asyncio.CancelledError:
            await self.cancel(rid)
            raise

    async def cancel(self, request_id: str) -> bool:
        """Stop a prefill; its blocks are freed now, or when its transfer ends."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None:
                return False
            pending.cancelled = True
            transferring = pending.transferring
        if not transferring:
            await self.loop.run(lambda e: e.abort(request_id))
            self._finish(request_id, exception=PrefillCancelled(f"prefill of {request_id} cancelled"))
        return True

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._transfers.shutdown(wait=True, cancel_futures=True)
        super().close()

    # ---- engine thread ----
    def _on_outputs(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            with self._lock:
                pending = self._pending.get(out.request_id)
                if pending is not None and not pending.cancelled:
                    pending.transferring = True
            if pending is None or pending.cancelled:
                engine.release_held(out.request_id)
                continue
            src = engine.held_block_ids(out.request_id)[pending.request.num_skip_blocks:]
            self._transfers.submit(self._transfer, pending, src, out)

    def _on_reservations(self, reservations: list[KVReservation]) -> None:
        assert not reservations, "a prefill worker computes its prompts itself; it reserves no blocks for others"

    def _on_request_failed(self, request_id: str, error: BaseException) -> None:
        self._finish(request_id, exception=error)

    def _on_fatal(self, error: BaseException) -> None:
        with self._lock:
            rids = list(self._pending)
        for rid in rids:
            self._finish(rid, exception=error)

    # ---- transfer threads ----
    def _transfer(self, pending: _Pending, src: list[int], first: RequestOutput) -> None:
        req = pending.request
        result, error = None, None
        try:
            if len(src) != len(req.dst_block_ids):
                raise TransferError(f"request {req.request_id}: {len(src)} prompt blocks to send, the decode worker "
                                    f"reserved {len(req.dst_block_ids)} (do the pools share one block_size?)")
            result = self.transport.write_blocks(req.kv_destination, src, req.dst_block_ids, req.request_id,
                                                 req.timeout_s)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            error = e
        # Release before answering: once the caller hears back, the blocks are evictable cache again.
        self.loop.call(lambda eng: eng.release_held(req.request_id))
        if result is None:
            self._finish(req.request_id, exception=error)
            return
        self.metrics.observe_transfer(result.num_bytes, result.seconds)
        self._finish(req.request_id, PrefillResult(
            req.request_id, first.new_token_ids[0], first.new_logprobs[0] if first.new_logprobs else None,
            first.num_cached_tokens, result.num_bytes, result.seconds,
            first.new_top_logprobs[0] if first.new_top_logprobs else None))

    def _finish(self, request_id: str, result: PrefillResult | None = None,
                exception: BaseException | None = None) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None or pending.result.done():
            return
        if exception is not None:
            if not isinstance(exception, PrefillCancelled):
                self.metrics.error(error_kind(exception))
            pending.result.set_exception(exception)
        else:
            assert result is not None
            pending.result.set_result(result)
