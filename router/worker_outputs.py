"""One decode worker's output stream to this router (workers/service/output_server.py): every request this router
runs there sends its chunks on it, a batch a decode step, and here they are handed to each request's stream.

    outputs = WorkerOutputs(actor, "decode-0")          # connects (one TCP connection for the router's life)
    async for chunk in outputs.stream(request): ...     # closing it early cancels the request on the worker
    outputs.retire()                                    # the worker left routing: close once its last request ends

One frame a decode step for all of this router's requests on the worker, on a socket of its own: a Ray stream
a request took an item a token (~0.5 ms of the router's CPU each, and as much of the worker's), a Ray stream a
worker an item a step (~0.5 and ~0.35 ms). Requests are started, cancelled and renewed by Ray calls. If the
connection breaks (the worker died), every request on it ends with ``OutputStreamLost``; the next request
connects afresh.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from workers.protocol.frames import read_frame, write_frame
from workers.protocol.messages import GenerateRequest, TokenChunk, pack, unpack, unpack_list
from workers.service.output_channel import RENEW_S, ChannelClosed


class OutputStreamLost(Exception):
    """The worker's output stream to this router ended or broke (``__cause__`` says how)."""


class WorkerOutputs:
    def __init__(self, actor: Any, worker_id: str) -> None:
        self.actor = actor
        self.worker_id = worker_id
        self.channel_id = uuid.uuid4().hex
        self.error: BaseException | None = None  # set once the stream has ended; the object is then spent
        self.retiring = False  # no new requests: close when the last one ends (a draining worker finishes them)
        self.num_batches = 0  # items received (a decode step's chunks each)
        self.loop = asyncio.get_running_loop()  # the reader and every request's queue live on this loop
        self._queues: dict[str, asyncio.Queue[TokenChunk | BaseException]] = {}
        self._attached: asyncio.Future[None] = self.loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
        self._renewer = asyncio.ensure_future(self._renew())

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks, the last with ``finished`` set; closing early cancels it on the worker."""
        await asyncio.shield(self._attached)  # the worker's channel exists before a request is started on it
        rid = request.request_id
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            try:
                ended = await self.actor.start.remote(self.channel_id, pack(request))
            except ChannelClosed as e:  # (Ray's error is an instance of the worker's) the channel is gone there
                self._end(e)
                raise OutputStreamLost(f"decode worker {self.worker_id!r} closed its output stream") from e
            if ended is not None:
                finished = True
                yield unpack(TokenChunk, ended)
                return
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise OutputStreamLost(f"decode worker {self.worker_id!r}'s output stream broke: {item}") from item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished and self.error is None:  # the consumer left: the worker frees what the request holds
                self.actor.cancel_request.remote(self.channel_id, rid)
            if self.retiring and not self._queues:
                self.close()

    def retire(self) -> None:
        """The worker left routing (draining, or gone): the requests still streaming from it go on to their end
        (a drain's promise), then the stream closes; at once if none is left."""
        self.retiring = True
        if not self._queues:
            self.close()

    def close(self) -> None:
        """Stop reading: the connection closes, so does the worker's channel, and every request still on it is
        cancelled there."""
        if not self.loop.is_closed():  # (a test's finished asyncio.run: its sockets closed with it)
            self._end(OutputStreamLost(f"the router closed its output stream from {self.worker_id!r}"))
            self._reader.cancel()  # its connection closes as it ends (_end has cancelled the renewer)

    async def _read(self) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            host, port = await self.actor.output_address.remote()
            reader, writer = await asyncio.open_connection(host, port)
            write_frame(writer, self.channel_id.encode())
            while (data := await read_frame(reader)) is not None:
                batch = unpack_list(TokenChunk, data)
                self.num_batches += 1
                if not self._attached.done():
                    self._attached.set_result(None)
                for chunk in batch:
                    queue = self._queues.get(chunk.request_id)
                    if queue is not None:  # else its consumer has left (a cancel is on its way)
                        queue.put_nowait(chunk)
            self._end(OutputStreamLost(f"decode worker {self.worker_id!r} closed its output stream"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the actor died, the connection broke: every request hears why
            self._end(e)
        finally:
            if writer is not None:
                writer.close()

    async def _renew(self) -> None:
        """Tell the worker this router is alive: it closes a channel unheard for a while (a dead router's)."""
        while self.error is None:
            await asyncio.sleep(RENEW_S)
            try:
                await self.actor.renew_channel.remote(self.channel_id)
            except Exception:  # noqa: BLE001 - the reader hears of a dead actor and ends the stream
                continue

    def _end(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        self._renewer.cancel()
        if not self._attached.done():
            self._attached.set_exception(error)
            self._attached.exception()  # retrieved: no "never retrieved" warning if no request was waiting
        for queue in self._queues.values():
            queue.put_nowait(error)
