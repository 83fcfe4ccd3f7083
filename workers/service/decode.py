"""A decode worker's logic, without Ray: admit, get the prompt's KV, stream tokens.

    async for chunk in service.generate(GenerateRequest(...)): ...

Remote prefill (``prefill_worker`` set): the engine reserves blocks for the whole prompt first (a
prefill never starts without a home for its KV), then the prefill worker is asked to fill the
blocks this worker does not already hold in its prefix cache; its first token joins the running
batch. Local prefill (``prefill_worker`` None): the engine computes the prompt itself.

Every exit path releases what the request holds: a failed prefill or transfer ends the stream with
an error chunk and frees the reserved blocks; a consumer that goes away (cancel, disconnect) aborts
the request, and if a prefill was in flight, cancels it and waits until it has ended so that no
write can land in blocks already handed to someone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.engine import Engine, RequestOutput, StepResult
from workers.engine.scheduler import KVReservation
from workers.protocol.errors import WorkerStopped, error_kind
from workers.protocol.messages import GenerateRequest, PrefillRequest, PrefillResult, TokenChunk
from workers.service.base import EngineService
from workers.service.output_channel import ChannelClosed, OutputChannel
from workers.service.publisher import PublishConfig
from workers.transport.base import KVTransport

log = logging.getLogger(__name__)


class PrefillClient(Protocol):
    """How a decode worker reaches prefill workers (Ray handles in a cluster, direct calls in tests)."""

    async def prefill(self, worker_id: str, request: PrefillRequest) -> PrefillResult: ...

    async def cancel(self, worker_id: str, request_id: str) -> None: ...


_Delivery = tuple["asyncio.Queue[RequestOutput | BaseException]", RequestOutput]  # an output for a stream's queue


@dataclass
class _Stream:
    """One request's life on this worker, shared by its generator and the engine thread's callbacks."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    reserved: asyncio.Future[KVReservation] | None = None  # set for a remote prefill
    prefill_call: asyncio.Future[PrefillResult] | None = None  # the remote prefill, once asked for
    # Prompt tokens the prefill worker served from its own prefix cache (reported as cached too).
    prefill_cached_tokens: int = 0
    finished: bool = False  # the last chunk was handed out: nothing is left to free


class DecodeService(EngineService):
    role = "decode"

    def __init__(self, engine: Engine, transport: KVTransport, worker_id: str, prefill_client: PrefillClient | None,
                 transfer_timeout_s: float = 30.0, publish: PublishConfig | None = None,
                 engine_threads: int | None = None):
        super().__init__(engine, transport, worker_id, publish, engine_threads)
        self.prefill_client = prefill_client
        self.transfer_timeout_s = transfer_timeout_s
        self._streams: dict[str, _Stream] = {}
        self._cleanups: set[asyncio.Future[None]] = set()
        self._channels: dict[str, OutputChannel] = {}
        # A step's outputs, held on the engine thread until the next step's layers start (workers/model/
        # compute_starts.py), that step ends, or the engine has nothing left to step.
        self._held: list[tuple[asyncio.AbstractEventLoop, list[_Delivery]]] = []

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's chunks; the last has ``finished`` set (an error chunk included)."""
        rid = request.request_id
        refusal = self._refusal(rid)
        if refusal is not None:
            yield self._error_chunk(rid, refusal)
            return
        # Prompt logprobs come from the prompt's logits, which only the engine computing it has: here. A
        # resumed request is recomputed here too (its output so far is part of what is prefilled).
        remote = (request.prefill_worker is not None and self.prefill_client is not None
                  and request.sampling.prompt_logprobs is None and not request.resume_token_ids)
        stream = _Stream(asyncio.get_running_loop())
        if remote:
            stream.reserved = stream.loop.create_future()
        self._streams[rid] = stream
        self.num_requests_started += 1
        try:
            async for chunk in self._serve(request, stream):
                yield chunk
        finally:
            self._streams.pop(rid, None)
            if not stream.finished:
                await self._abandon(request, stream)

    # ---- output channels (output_channel.py): a router's requests on one stream, a batch a step ----
    async def subscribe(self, channel_id: str) -> AsyncGenerator[list[TokenChunk], None]:
        """The chunks of every request started on this channel: [] once attached, then a batch at each
        wake-up. Closing it (the consumer left) cancels those requests."""
        if channel_id in self._channels:
            raise ValueError(f"output channel {channel_id!r} is already subscribed")
        channel = self._channels[channel_id] = OutputChannel()
        self.metrics.output_channels.set(len(self._channels))
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            self._channels.pop(channel_id, None)
            channel.close()
            self.metrics.output_channels.set(len(self._channels))
            if channel.expired:
                self.metrics.output_channels_expired.inc()

    def start_on(self, channel_id: str, request: GenerateRequest) -> None:
        """Run a request whose chunks go to a subscribed channel."""
        channel = self._channels.get(channel_id)
        if channel is None:
            raise ChannelClosed(f"no output channel {channel_id!r} on worker {self.worker_id} (never subscribed, "
                                "or its consumer has gone)")
        channel.start(request.request_id, self.generate(request))

    def renew_channel(self, channel_id: str) -> bool:
        """The channel's consumer is alive (output_channel.py: an unrenewed channel closes); False: it is gone."""
        channel = self._channels.get(channel_id)
        return channel is not None and channel.renew()

    def cancel_on(self, channel_id: str, request_id: str) -> bool:
        """The consumer no longer wants a request started on its channel: abort it, freeing what it holds."""
        channel = self._channels.get(channel_id)
        return channel is not None and channel.cancel(request_id)

    def _refusal(self, request_id: str) -> Exception | None:
        if request_id in self._streams:
            return ValueError(f"request id {request_id!r} is already streaming here")
        if self._closed:
            return WorkerStopped(f"worker {self.worker_id} has stopped")
        return None

    async def _serve(self, request: GenerateRequest, stream: _Stream) -> AsyncGenerator[TokenChunk, None]:
        """Admit, get the prompt's KV (from a prefill worker or computed here), then relay the outputs."""
        rid = request.request_id
        try:
            await self.loop.run(lambda e: e.add_request(
                request.prompt_token_ids, request.sampling, request_id=rid, cache_salt=request.cache_salt,
                remote_prefill=stream.reserved is not None, resume_token_ids=request.resume_token_ids))
        except Exception as e:  # noqa: BLE001 - bad input becomes an error chunk, never a crash
            yield self._fail(stream, rid, e)
            return
        if stream.reserved is not None:
            first = await self._remote_prefill(request, stream)
            if first is None:
                return  # aborted meanwhile
            yield first
        while not stream.finished:
            item = await stream.outputs.get()
            yield self._fail(stream, rid, item) if isinstance(item, BaseException) else self._chunk(item, stream)

    async def _remote_prefill(self, request: GenerateRequest, stream: _Stream) -> TokenChunk | None:
        """Once the prompt's blocks are reserved, have the prefill worker fill them; its first token joins
        the batch. A failed prefill or transfer frees the blocks and gives an error chunk; None: aborted."""
        assert stream.reserved is not None
        rid = request.request_id
        try:
            reservation = await stream.reserved
        except Exception as e:  # noqa: BLE001 - shed while waiting for blocks, or the engine stopped
            return self._fail(stream, rid, e)
        stream.prefill_call = asyncio.ensure_future(self._prefill(request, reservation))
        try:
            result = await asyncio.shield(stream.prefill_call)
        except Exception as e:  # noqa: BLE001 - the stream ends with the reason
            await self.loop.run(lambda eng: eng.abort(rid))
            return self._fail(stream, rid, e)
        first = await self.loop.run(
            lambda e: e.commit_remote_kv(rid, result.token_id, result.logprob, result.top_logprobs))
        if first is None:
            return None
        stream.prefill_cached_tokens = result.num_cached_tokens
        return self._chunk(first, stream)

    async def _abandon(self, request: GenerateRequest, stream: _Stream) -> None:
        """The consumer left before the end: free what the request holds, in a task of its own, so a
        consumer cancelled by a scope that keeps cancelling (anyio) cannot cut the cleanup short."""
        cleanup = asyncio.ensure_future(self._cancel(request, stream.prefill_call))
        self._cleanups.add(cleanup)  # a strong reference until it is done
        cleanup.add_done_callback(self._cleanups.discard)
        await asyncio.shield(cleanup)

    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._cleanups)

    async def _prefill(self, request: GenerateRequest, reservation: KVReservation) -> PrefillResult:
        assert self.prefill_client is not None and request.prefill_worker is not None
        skip = reservation.num_cached_tokens // self.loop.engine.block_pool.block_size
        return await self.prefill_client.prefill(request.prefill_worker, PrefillRequest(
            request.request_id, request.prompt_token_ids, request.sampling, request.cache_salt,
            self.transport.address(), reservation.block_ids[skip:], skip, self.transfer_timeout_s))

    async def _cancel(self, request: GenerateRequest, prefill_call: asyncio.Future[PrefillResult] | None) -> None:
        """Free everything of an abandoned request, after any in-flight prefill has ended: its KV writes land
        in the reserved blocks, which must not go to another request while a write may still come. The
        call ends when the prefill worker finishes, fails its transfer (its own timeout), or is gone (the
        controller kills one that stops answering)."""
        rid = request.request_id
        if prefill_call is not None and not prefill_call.done():
            assert self.prefill_client is not None and request.prefill_worker is not None
            with contextlib.suppress(BaseException):  # the cancel is a hint; the call's end is what counts
                await asyncio.wait_for(self.prefill_client.cancel(request.prefill_worker, rid), 5.0)
            with contextlib.suppress(BaseException):  # ended, failed or gone: the blocks can go now
                await asyncio.shield(prefill_call)
        await self.loop.run(lambda e: e.abort(rid))

    # ---- chunks ----
    def _chunk(self, out: RequestOutput, stream: _Stream) -> TokenChunk:
        stream.finished = out.finished
        if out.finished and out.finish_reason:
            self.metrics.finished(out.finish_reason)
        return TokenChunk(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs, out.finished,
                          out.finish_reason, out.stop_reason, out.num_prompt_tokens, out.num_output_tokens,
                          max(out.num_cached_tokens, stream.prefill_cached_tokens),
                          top_logprobs=out.new_top_logprobs, prompt_logprobs=out.prompt_logprobs,
                          queue_seconds=out.queue_seconds)

    def _fail(self, stream: _Stream, request_id: str, error: BaseException) -> TokenChunk:
        """The stream's last chunk, saying why it ends (what it held is freed already)."""
        stream.finished = True
        return self._error_chunk(request_id, error)

    def _error_chunk(self, request_id: str, error: BaseException) -> TokenChunk:
        kind = error_kind(error)
        self.metrics.error(kind)
        message = str(error) or type(error).__name__
        return TokenChunk(request_id, finished=True, finish_reason="error", error=message, error_kind=kind)

    # ---- engine thread ----
    def _on_step(self, engine: Engine, result: StepResult, seconds: float) -> None:
        self._hand_over()  # the step before's outputs, if this step's layers did not take them (no forward ran)
        super()._on_step(engine, result, seconds)
        if not engine.has_unfinished:
            self._hand_over()  # no next step to wait for

    def _on_outputs(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop a step, not one per output: every wake-up is a thread switch that
        # takes a core from the engine's threads in the middle of the next step.
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.outputs, out))
        self._held.extend(by_loop.items())

    def _compute_starts(self) -> None:
        self._hand_over()

    def _hand_over(self) -> None:
        """The held outputs to their event loops (engine thread: its layers start, a step's end)."""
        held, self._held = self._held, []
        for loop, deliveries in held:
            loop.call_soon_threadsafe(_deliver, deliveries)

    def _on_reservations(self, reservations: list[KVReservation]) -> None:
        for reservation in reservations:
            stream = self._streams.get(reservation.request_id)
            if stream is not None and stream.reserved is not None:
                stream.loop.call_soon_threadsafe(_resolve, stream.reserved, reservation)

    def _on_request_failed(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
            if stream.reserved is not None:
                stream.loop.call_soon_threadsafe(_fail, stream.reserved, error)

    def _on_fatal(self, error: BaseException) -> None:
        self._hand_over()  # (on the engine thread as it stops, or once it has: nothing else touches what is held)
        for request_id in list(self._streams):
            self._on_request_failed(request_id, error)


def _deliver(deliveries: list[_Delivery]) -> None:
    for queue, out in deliveries:
        queue.put_nowait(out)


def _resolve(future: asyncio.Future[KVReservation], value: KVReservation) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[KVReservation], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
