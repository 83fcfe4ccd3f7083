"""``tcp`` KV transport: asyncio sockets, no extra dependency, always available.

Each worker runs a small server on a background event-loop thread. A transfer is one connection:

    sender -> header (4-byte length + msgpack: request id, runs, bytes per block slab, layers)
    receiver -> accept, or refuse with the reason (layout or block range wrong)
    sender -> payload: for each run, for each (layer, K/V) slab, the run's bytes
    receiver reads each piece straight into its cache's memory (no intermediate copy on CPU)
    receiver -> done

Frames are a 4-byte length and msgpack. The accept costs a round trip and buys a clear error
instead of a broken pipe when the receiver refuses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from workers.kv_transport import (
    BlockRun,
    CacheLayout,
    KVTransport,
    TransferError,
    TransferResult,
    check_cache_layout,
    coalesce_runs,
    layout_error,
    run_segments,
)

_LEN = struct.Struct("<I")
_MAX_HEADER = 16 << 20
# Large kernel buffers: fewer event-loop wakeups per transfer (KV transfers are tens of MiB).
_SOCKET_BUFFER_BYTES = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)


class TcpTransport(KVTransport):
    backend = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, read_timeout_s: float = 30.0):
        self.host = host
        self.read_timeout_s = read_timeout_s
        self.kv_cache: torch.Tensor | None = None
        self.num_bytes_received = 0
        self._loop = asyncio.new_event_loop()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-kv-transport", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop)

    # ---- KVTransport ----
    def register(self, kv_cache: torch.Tensor) -> None:
        check_cache_layout(kv_cache)
        self.kv_cache = kv_cache

    def address(self) -> dict[str, Any]:
        return {"backend": self.backend, "host": self.host, "port": self.port}

    def write_blocks(self, peer: dict[str, Any], src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                     request_id: str, timeout_s: float) -> TransferResult:
        if self.kv_cache is None:
            raise TransferError("no KV cache registered on the sending side")
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        t0 = time.perf_counter()
        future = asyncio.run_coroutine_threadsafe(self._send(peer, runs, request_id), self._loop)
        try:
            num_bytes = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransferError(f"transfer {request_id} to {peer.get('host')}:{peer.get('port')} "
                                f"timed out after {timeout_s}s") from None
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            raise TransferError(f"transfer {request_id} to {peer.get('host')}:{peer.get('port')} failed: "
                                f"{type(e).__name__}: {e}") from e
        return TransferResult(request_id, num_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        if self._loop.is_closed() or not self._loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Stop accepting, end every task of this loop (transfers in flight fail on the peer's side)."""
        self._listener.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- sending ----
    async def _send(self, peer: dict[str, Any], runs: list[BlockRun], request_id: str) -> int:
        assert self.kv_cache is not None
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await loop.sock_connect(sock, (peer["host"], int(peer["port"])))
            header = msgpack.packb({
                "request_id": request_id, "runs": [[r.dst_start, r.num_blocks] for r in runs],
                "layout": list(CacheLayout.of(self.kv_cache)),
            })
            await loop.sock_sendall(sock, _LEN.pack(len(header)) + header)
            await _expect_ok(loop, sock)
            sent = 0
            for run in runs:
                for seg in run_segments(self.kv_cache, run.src_start, run.num_blocks):
                    buf = _as_bytes(seg)
                    await loop.sock_sendall(sock, buf)
                    sent += len(buf)
            await _expect_ok(loop, sock)
            return sent
        finally:
            sock.close()

    # ---- receiving ----
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            _tune(conn)
            loop.create_task(self._receive(conn))

    async def _receive(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            header = msgpack.unpackb(await asyncio.wait_for(_recv_frame(loop, conn), self.read_timeout_s))
            error = self._check_header(header)
            await _send_frame(loop, conn, {"ok": error is None, "error": error})
            if error is not None:
                return
            assert self.kv_cache is not None
            for dst_start, num_blocks in header["runs"]:
                for seg in run_segments(self.kv_cache, dst_start, num_blocks):
                    await asyncio.wait_for(_recv_into(loop, conn, seg), self.read_timeout_s)
                    self.num_bytes_received += seg.numel() * seg.element_size()
            await _send_frame(loop, conn, {"ok": True, "error": None})
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            pass  # the sender sees the broken connection and reports it; the receiver's blocks stay reserved
        finally:
            conn.close()

    def _check_header(self, header: dict[str, Any]) -> str | None:
        receiver = CacheLayout.of(self.kv_cache) if self.kv_cache is not None else None
        return layout_error(receiver, CacheLayout(*header["layout"]), header["runs"])


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.view(torch.uint8).numpy().data.cast("B")


def _as_bytes(t: torch.Tensor) -> memoryview:
    host = t if t.device.type == "cpu" else t.cpu()  # GPU caches stage through host memory on TCP
    return _byte_view(host.contiguous())


async def _send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, obj: dict[str, Any]) -> None:
    payload = msgpack.packb(obj)
    await loop.sock_sendall(sock, _LEN.pack(len(payload)) + payload)


async def _expect_ok(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    reply = msgpack.unpackb(await _recv_frame(loop, sock))
    if not reply.get("ok"):
        raise ValueError(f"receiver refused: {reply.get('error')}")


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    size = _LEN.unpack(await _recv_exactly(loop, sock, _LEN.size))[0]
    if size > _MAX_HEADER:
        raise ValueError(f"frame of {size} bytes is too large")
    return await _recv_exactly(loop, sock, size)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    await _fill(loop, sock, memoryview(buf))
    return bytes(buf)


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, dst: torch.Tensor) -> None:
    if dst.device.type == "cpu":
        await _fill(loop, sock, _byte_view(dst))
        return
    staging = torch.empty(dst.numel() * dst.element_size(), dtype=torch.uint8)
    await _fill(loop, sock, _byte_view(staging))
    dst.view(torch.uint8).view(-1).copy_(staging)


async def _fill(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise asyncio.IncompleteReadError(b"", len(view) - got)
        got += n
