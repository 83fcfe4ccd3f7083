"""A decode worker's output channels (output_channel.py) to its routers over TCP: a connection a router, a frame a
decode step.

Ray carried them as a streaming call before, an item a step: each item cost ~0.35 ms of the worker's CPU and
~0.5 ms of the router's (an actor yielding 600-byte items 7 ms apart; over a socket 0.09 and 0.05). On a small
host the router, the worker's own threads and the decode step's thread team share the cores, and a core taken
from either thread of the team stalls both: at 8 chats a step took 7.2 ms served against 4.3 in a quiet process.
Requests are still started, cancelled and renewed by Ray calls; only their chunks take the socket.

    server = OutputServer(service, host)
    host, port = await server.start()       # on the worker's event loop; routers ask for this address
    # A router connects, sends one frame (its channel id) and reads frames (workers/protocol/frames.py): [] once
    # the channel exists, then a batch of chunks a wake-up (pack_list). The connection ending, from either side,
    # closes the channel: every request on it is cancelled on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from workers.protocol.frames import FrameError, read_frame, write_frame
from workers.protocol.messages import pack_list
from workers.service.decode import DecodeService
from workers.service.output_channel import TTL_S

log = logging.getLogger(__name__)

_MAX_CHANNEL_ID_BYTES = 256


class OutputServer:
    def __init__(self, service: DecodeService, host: str, hello_timeout_s: float = 10.0,
                 stall_timeout_s: float = TTL_S):
        """``stall_timeout_s``: a router that reads nothing for this long (its buffers full) is treated as one
        that stopped renewing its channel: the connection closes, and its requests with it."""
        self.service = service
        self.host = host
        self.hello_timeout_s = hello_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        """Listen (once; later calls give the same address): (host, port) for routers to connect to."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self.host, int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop listening (the worker stops); connections end with the event loop or their channel."""
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                hello = await read_frame(reader, _MAX_CHANNEL_ID_BYTES)
            if hello is not None:
                await self._send(hello.decode("utf-8", errors="replace"), reader, writer)
        except (TimeoutError, FrameError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.info("output stream to %s ended: %s", writer.get_extra_info("peername"), e or type(e).__name__)
        except ValueError as e:  # the channel id is subscribed already
            log.warning("output stream refused: %s", e)
        finally:
            writer.close()

    async def _send(self, channel_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The channel's batches, a frame each, until either side ends it; the router closing its end (or
        going away) cancels the sending, which closes the channel."""
        sender = asyncio.current_task()
        assert sender is not None
        peer_gone = False

        async def watch() -> None:  # a router sends nothing after its hello: reading ends when it goes
            nonlocal peer_gone
            with contextlib.suppress(ConnectionError):
                while await reader.read(4096):
                    pass
            peer_gone = True
            sender.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            async with contextlib.aclosing(self.service.subscribe(channel_id)) as batches:
                async for batch in batches:
                    write_frame(writer, pack_list(batch))
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that comes as the
                    # drain completes, and the watcher's would be lost (the channel then lived on to its TTL).
                    async with asyncio.timeout(self.stall_timeout_s):
                        await writer.drain()
        except asyncio.CancelledError:
            if not peer_gone:
                raise  # the worker's loop is stopping: not ours to swallow
            sender.uncancel()
        finally:
            watcher.cancel()
