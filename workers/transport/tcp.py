"""``tcp`` KV transport: plain sockets, no extra dependency, always available.

Each worker runs a listener thread; every transfer is one connection, served by a thread of its own:

    sender -> header (4-byte length + msgpack: request id, runs, bytes per block slab, layers)
    receiver -> accept, or refuse with the reason (layout or block range wrong)
    sender -> payload: for each run, for each (layer, K/V) slab, the run's bytes
    receiver reads each piece straight into its cache's memory (no intermediate copy on CPU)
    receiver -> done

On one host (same boot, same PID namespace, CPU caches) the payload skips the socket: after the
receiver's accept, the sender copies the spans straight into the receiver's cache with
``process_vm_writev`` (``same_host_copy``) and says so in a small frame. Where the kernel
refuses that call, the sender says "not written" and sends the payload on the socket as above, and
keeps to the socket from then on.

Blocking sockets in threads, with scatter/gather I/O: one ``sendmsg`` / ``recvmsg_into`` call moves up
to IOV_MAX pieces, so a transfer of scattered blocks costs a few system calls instead of one per
(block, layer, K/V). The kernel's buffer autotuning is left on: a fixed SO_SNDBUF turns it off and
was ~20% slower here. The accept costs a round trip and buys a clear error instead of a broken pipe
when the receiver refuses.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from workers.protocol.errors import TransferError
from workers.transport.base import (
    BlockRun,
    CacheLayout,
    KVTransport,
    TransferResult,
    check_cache_layout,
    coalesce_runs,
    layout_error,
)
from workers.transport.same_host_copy import host_identity, write_to_process

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_MAX_HEADER = 16 << 20
_TIMEVAL = struct.Struct("@ll")  # struct timeval
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # pieces per sendmsg/recvmsg_into call


class Deadline:
    """Gives each blocking call on a socket the time left of the whole transfer.

    The limit is the kernel's (SO_SNDTIMEO / SO_RCVTIMEO), not Python's ``settimeout``: that one makes
    the socket non-blocking and polls before every call, which cost ~30% of the throughput here.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def arm(self, sock: socket.socket) -> None:
        left = self.left()
        if left <= 0:
            raise TimeoutError(f"timed out after {self.seconds}s")
        _kernel_timeouts(sock, left)


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking calls on ``sock`` give up after ``seconds`` (EAGAIN, or a partial count)."""
    whole = int(seconds)
    value = _TIMEVAL.pack(whole, max(int((seconds - whole) * 1e6), 1 if whole == 0 else 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def _blocking(sock: socket.socket) -> socket.socket:
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class TcpTransport(KVTransport):
    backend = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, read_timeout_s: float = 30.0,
                 same_host_copy: bool = True):
        self.host = host
        self.read_timeout_s = read_timeout_s
        self.host_id = host_identity() if same_host_copy else None  # None: always the socket
        self.kv_cache: torch.Tensor | None = None
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="tcp-kv-transport", daemon=True)
        self._thread.start()

    # ---- KVTransport ----
    def register(self, kv_cache: torch.Tensor) -> None:
        check_cache_layout(kv_cache)
        self.kv_cache = kv_cache

    def address(self) -> dict[str, Any]:
        address: dict[str, Any] = {"backend": self.backend, "host": self.host, "port": self.port}
        if self.host_id is not None and self.kv_cache is not None and self.kv_cache.device.type == "cpu":
            address.update(host_id=self.host_id, pid=os.getpid(), base=self.kv_cache.data_ptr(),
                           num_blocks=self.kv_cache.shape[2])
        return address

    def write_blocks(self, peer: dict[str, Any], src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                     request_id: str, timeout_s: float) -> TransferResult:
        if self.kv_cache is None:
            raise TransferError("no KV cache registered on the sending side")
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        where = f"transfer {request_id} to {peer.get('host')}:{peer.get('port')}"
        if peer.get("backend", self.backend) != self.backend:
            raise TransferError(f"{where}: backend mismatch: the sender speaks {self.backend}, "
                                f"the receiver {peer['backend']}")
        t0 = time.perf_counter()
        try:
            num_bytes = self._send(peer, runs, request_id, Deadline(timeout_s))
        except (TimeoutError, BlockingIOError):  # BlockingIOError: a kernel timeout (EAGAIN) ran out
            raise TransferError(f"{where} timed out after {timeout_s}s") from None
        except (OSError, ValueError) as e:
            raise TransferError(f"{where} failed: {type(e).__name__}: {e}") from e
        return TransferResult(request_id, num_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        """Stop accepting and end the transfers being received (their senders see the broken connection)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._conns_lock:
            open_socks = [self._listener, *self._conns]
        for sock in open_socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept/recv on it
            except OSError:
                pass
        self._thread.join(timeout=5)
        self._listener.close()

    # ---- sending ----
    def _send(self, peer: dict[str, Any], runs: list[BlockRun], request_id: str, deadline: Deadline) -> int:
        assert self.kv_cache is not None
        layout = CacheLayout.of(self.kv_cache)
        header = {"request_id": request_id, "runs": [[r.dst_start, r.num_blocks] for r in runs],
                  "layout": list(layout), "backend": self.backend, **self._payload_fields(peer)}
        spans = [span for run in runs for span in layout.run_spans(run.src_start, run.num_blocks)]
        with _blocking(socket.create_connection((peer["host"], int(peer["port"])), timeout=deadline.seconds)) as sock:
            _send_all(sock, [_frame(header)], deadline)
            _expect_ok(sock, deadline)
            self._send_payload(sock, header, peer, runs, spans, deadline)
            _expect_ok(sock, deadline)
        return sum(n for _, n in spans)

    # ---- the payload: the part a subclass moves another way (nccl_transport) ----
    def _payload_fields(self, peer: dict[str, Any]) -> dict[str, Any]:
        """What the header says about how the payload travels."""
        # The receiver accepts a direct write only into itself: an address outlived by its
        # process (pid and port both reused) is refused, never written into. Its block count places
        # each (layer, K/V) slab: the two pools are rarely the same size.
        direct = [int(peer["pid"]), int(peer["base"]), int(peer["num_blocks"])] if self._same_host(peer) else None
        return {"direct": direct}

    def _send_payload(self, sock: socket.socket, header: dict[str, Any], peer: dict[str, Any],
                      runs: list[BlockRun], spans: list[tuple[int, int]], deadline: Deadline) -> None:
        assert self.kv_cache is not None
        if header["direct"]:
            written = self._write_direct(peer, runs, spans)
            _send_all(sock, [_frame({"written": written})], deadline)
            if written:
                return
        _send_all(sock, _source_pieces(self.kv_cache, spans), deadline)

    def _receive_payload(self, conn: socket.socket, header: dict[str, Any], spans: list[tuple[int, int]]) -> None:
        assert self.kv_cache is not None
        written = header.get("direct") and msgpack.unpackb(_recv_frame(conn))["written"]
        if not written:
            _recv_spans(conn, self.kv_cache, spans)

    def _check_payload(self, header: dict[str, Any]) -> str | None:
        """Why this receiver cannot take the payload the way the header says, or None."""
        direct = header.get("direct")
        if direct and (self.kv_cache is None
                       or direct != [os.getpid(), self.kv_cache.data_ptr(), self.kv_cache.shape[2]]):
            return f"stale address: a same-host copy into pid {direct[0]}, which is not this receiver's cache"
        return None

    def _same_host(self, peer: dict[str, Any]) -> bool:
        assert self.kv_cache is not None
        return (self.host_id is not None and peer.get("host_id") == self.host_id
                and self.kv_cache.device.type == "cpu")

    def _write_direct(self, peer: dict[str, Any], runs: list[BlockRun], spans: list[tuple[int, int]]) -> bool:
        """Copy the spans into the peer's cache; False where the kernel forbids it (then: the socket)."""
        assert self.kv_cache is not None
        ours = CacheLayout.of(self.kv_cache)
        receiver = CacheLayout(ours.num_layers, int(peer["num_blocks"]), ours.slab_block_bytes)
        remote = [span for run in runs for span in receiver.run_spans(run.dst_start, run.num_blocks)]
        triples = [(src, dst, n) for (src, n), (dst, _) in zip(spans, remote, strict=True)]
        try:
            write_to_process(int(peer["pid"]), self.kv_cache.data_ptr(), int(peer["base"]), triples)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise  # the peer is gone (ESRCH) or its address is wrong (EFAULT): the transfer fails
            log.warning("same-host copy refused by the kernel (%s); KV transfers use the socket", e)
            self.host_id = None
            return False
        return True

    # ---- receiving ----
    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            _blocking(conn)
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._receive, args=(conn,), name="tcp-kv-receive", daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        try:
            _kernel_timeouts(conn, self.read_timeout_s)
            header = msgpack.unpackb(_recv_frame(conn))
            error = self._check_header(header)
            _send_frame(conn, {"ok": error is None, "error": error})
            if error is not None:
                return
            assert self.kv_cache is not None
            layout = CacheLayout.of(self.kv_cache)
            spans = [span for start, count in header["runs"] for span in layout.run_spans(start, count)]
            self._receive_payload(conn, header, spans)
            _send_frame(conn, {"ok": True, "error": None})
        except (OSError, ValueError, KeyError, msgpack.UnpackException):
            pass  # the sender sees the broken connection and reports it; the receiver's blocks stay reserved
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _check_header(self, header: dict[str, Any]) -> str | None:
        if header.get("backend") != self.backend:  # the payload would travel a way this end does not read
            return f"backend mismatch: the sender speaks {header.get('backend')}, the receiver {self.backend}"
        receiver = CacheLayout.of(self.kv_cache) if self.kv_cache is not None else None
        return (layout_error(receiver, CacheLayout(*header["layout"]), header["runs"])
                or self._check_payload(header))


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.view(torch.uint8).numpy().data.cast("B")


def _flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1).view(torch.uint8)


def _source_pieces(cache: torch.Tensor, spans: list[tuple[int, int]]) -> list[memoryview]:
    if cache.device.type == "cpu":
        whole = _byte_view(cache.view(-1))
        return [whole[off : off + n] for off, n in spans]
    flat = _flat_bytes(cache)  # GPU caches stage through host memory on TCP
    return [_byte_view(flat[off : off + n].cpu()) for off, n in spans]


def _io_stack(pieces: Sequence[memoryview | bytes]) -> list[memoryview]:
    """Pieces as a stack, the first piece on top (popped from the end: O(1) per finished piece)."""
    stack = [memoryview(p) for p in pieces if len(p)]
    stack.reverse()
    return stack


def _pop_bytes(stack: list[memoryview], n: int) -> None:
    """Take the ``n`` bytes that one sendmsg/recvmsg_into moved off the top of ``stack``."""
    while n:
        if n >= len(stack[-1]):
            n -= len(stack.pop())
        else:
            stack[-1] = stack[-1][n:]
            n = 0


def _send_all(sock: socket.socket, pieces: Sequence[memoryview | bytes], deadline: Deadline) -> None:
    stack = _io_stack(pieces)
    while stack:
        deadline.arm(sock)
        _pop_bytes(stack, sock.sendmsg(stack[-1:-_IOV_MAX - 1:-1]))


def _recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    stack = _io_stack(views)
    while stack:
        n = sock.recvmsg_into(stack[-1:-_IOV_MAX - 1:-1])[0]
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        _pop_bytes(stack, n)


def _recv_spans(sock: socket.socket, cache: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """Receive the payload straight into ``spans`` of the cache."""
    if cache.device.type == "cpu":
        whole = _byte_view(cache.view(-1))
        _recv_into_views(sock, [whole[off : off + n] for off, n in spans])
    else:
        staging = torch.empty(sum(n for _, n in spans), dtype=torch.uint8)
        _recv_into_views(sock, [_byte_view(staging)])
        flat, at = _flat_bytes(cache), 0
        for off, n in spans:
            flat[off : off + n].copy_(staging[at : at + n])
            at += n


def _frame(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj)
    return _LEN.pack(len(payload)) + payload


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(_frame(obj))


def _expect_ok(sock: socket.socket, deadline: Deadline) -> None:
    deadline.arm(sock)
    reply = msgpack.unpackb(_recv_frame(sock))
    if not reply.get("ok"):
        raise ValueError(f"receiver refused: {reply.get('error')}")


def _recv_frame(sock: socket.socket) -> bytes:
    head = bytearray(_LEN.size)
    _recv_into_views(sock, [memoryview(head)])
    size = _LEN.unpack(head)[0]
    if size > _MAX_HEADER:
        raise ValueError(f"frame of {size} bytes is too large")
    body = bytearray(size)
    _recv_into_views(sock, [memoryview(body)])
    return bytes(body)
