"""Many requests' chunks on one stream to one consumer (a router), a batch at each wake-up.

One Ray streaming item a token cost the router ~0.5 ms of CPU and the decode worker as much again (a gRPC
report, an object in the owner's store, a callback into the router's event loop): a router process relayed at
most ~1,700 tokens a second on two cores, a fifteenth of what one H100 decode worker makes. Here each request's
chunks go into its router's channel, and the channel hands out everything that arrived since its last item: one
item a decode step for all of that router's requests (vLLM's engine core and SGLang's detokenizer batch their
outputs to the API server a step at a time alike). The channel's batches go to their router over a connection of
their own (output_server.py).

    channel = OutputChannel()
    channel.start("r1", service.generate(request))   # the request runs; its chunks join the channel
    async for batch in channel.batches(): ...           # [] first (the consumer may start requests), then chunks
    channel.cancel("r1")                               # the consumer left: the request is cancelled and freed

When the consumer stops reading (``batches`` closed: the router cancelled its subscription), every request it
started is cancelled, as a closed per-request stream cancels its request. A router that dies says nothing (Ray
cancels no actor call of a dead caller: its requests ran to their last token, up to max_model_len for chats
without max_tokens), so a consumer renews its channel every few seconds, and a channel not heard from for
``ttl_s`` closes itself, with the same effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from workers.protocol.errors import error_kind
from workers.protocol.messages import TokenChunk


class ChannelClosed(Exception):
    """A request was started on a channel whose consumer has gone."""


# A consumer renews every RENEW_S; a channel unheard for TTL_S closes (three renewals missed: a busy event loop on
# either side delays one, not three).
RENEW_S, TTL_S = 5.0, 15.0


class OutputChannel:
    def __init__(self, ttl_s: float = TTL_S) -> None:
        self._chunks: list[TokenChunk] = []
        self._arrived = asyncio.Event()
        self._requests: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        self.expired = False  # closed because its consumer stopped renewing it (a dead or stalled router)
        self.ttl_s = ttl_s
        self._heard = time.monotonic()

    def renew(self) -> bool:
        """The consumer is alive; False if the channel has closed already."""
        self._heard = time.monotonic()
        return not self._closed

    def start(self, request_id: str, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        """Relay ``chunks`` (a request's stream) into the channel until it ends or is cancelled."""
        if self._closed:
            raise ChannelClosed(f"the output channel for request {request_id!r} is closed")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already streaming on this channel")
        task = asyncio.ensure_future(self._relay(request_id, chunks))
        self._requests[request_id] = task
        task.add_done_callback(lambda _: self._requests.pop(request_id, None))

    def cancel(self, request_id: str) -> bool:
        """Cancel a request started here (its stream's cleanup frees what it holds); False if it has ended."""
        task = self._requests.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    async def batches(self) -> AsyncIterator[list[TokenChunk]]:
        """An empty batch first (the channel is attached), then each wake-up's chunks, in each request's order;
        ends once the channel closes (``close``, or unrenewed for ttl_s)."""
        try:
            yield []
            while not self._closed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.ttl_s / 3):
                        await self._arrived.wait()
                if time.monotonic() - self._heard > self.ttl_s:
                    self.expired = True
                    break
                self._arrived.clear()
                batch, self._chunks = self._chunks, []
                if batch:
                    yield batch
        finally:
            self.close()

    def close(self) -> None:
        """No one reads the channel any more: cancel every request it carries (and end ``batches``)."""
        self._closed = True
        self._arrived.set()
        for task in list(self._requests.values()):
            task.cancel()

    async def _relay(self, request_id: str, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        finished = False
        try:
            # aclosing: a cancelled relay closes the request's stream now, which aborts the request (its finally).
            async with contextlib.aclosing(chunks) as stream:
                async for chunk in stream:
                    finished = chunk.finished
                    self._put(chunk)
        except Exception as e:  # noqa: BLE001 - the consumer must hear of it, not wait for a last chunk forever
            self._put(TokenChunk(request_id, finished=True, finish_reason="error", error=f"{type(e).__name__}: {e}",
                                 error_kind=error_kind(e)))
            return
        if not finished:
            self._put(TokenChunk(request_id, finished=True, finish_reason="error",
                                 error="the stream ended without a last chunk", error_kind="internal"))

    def _put(self, chunk: TokenChunk) -> None:
        self._chunks.append(chunk)
        self._arrived.set()
