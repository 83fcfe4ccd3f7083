"""``nccl`` KV transport: the payload moves as collective send/recv over a torch.distributed group of two.

Between GPU caches the group is NCCL (NVLink, InfiniBand, or PCIe, as NCCL finds); between CPU caches
the same code runs over gloo, which is how it is tested without a GPU. The control path is the tcp
transport's (header, accept or refuse with the reason, done), so refusals and timeouts read the same
for every backend; only the payload differs:

    sender: gather the source blocks into one staging tensor per piece (``index_select``: on a GPU, one
            kernel), ``send`` it to rank 1
    receiver: ``recv`` into staging, scatter into the destination blocks (``index_copy_``)

Pieces hold at most ``piece_bytes`` so staging memory stays bounded. A pair group (sender rank 0,
receiver rank 1) is made on the first transfer between two workers, meeting through a TCPStore the
receiver hosts, and kept. Transfers between one pair take turns: NCCL matches sends to receives by
order, not by tag. A group that failed is dropped on both sides; the next transfer makes a new one
under a new key (a key is never reused, so no stale rendezvous data is read).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.transport.base import BlockRun
from workers.transport.tcp import Deadline, TcpTransport

_POLL_S = 0.0002  # how often a thread waiting on a send or receive looks at it
_Group = Any  # a c10d ProcessGroupGloo or ProcessGroupNCCL (a Backend, used directly: no global group)


@dataclass
class _PairGroup:
    key: str  # "<sender id>/<generation>"
    group: _Group | None = None  # made by the first payload under this key
    store: dist.Store | None = None  # the sender's client of the receiver's store, kept with the group


class NcclTransport(TcpTransport):
    backend = "nccl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, read_timeout_s: float = 30.0,
                 piece_bytes: int = 64 << 20):
        super().__init__(host=host, port=port, read_timeout_s=read_timeout_s, same_host_copy=False)
        self.id = uuid.uuid4().hex[:12]
        self.piece_bytes = piece_bytes
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._generations = itertools.count(1)
        self._groups_lock = threading.Lock()
        self._sending: dict[str, _PairGroup] = {}  # receiver id -> group
        self._pair_locks: dict[str, threading.Lock] = {}  # receiver id -> one transfer at a time
        self._receiving: dict[str, _Group] = {}  # key -> group

    @property
    def collective(self) -> str:
        return "nccl" if self.kv_cache is not None and self.kv_cache.device.type == "cuda" else "gloo"

    def address(self) -> dict[str, Any]:
        return {**super().address(), "id": self.id, "store_port": int(self._store.port),
                "collective": self.collective}

    def close(self) -> None:
        super().close()
        with self._groups_lock:
            groups = [p.group for p in self._sending.values()] + list(self._receiving.values())
            self._sending.clear()
            self._receiving.clear()
        for group in groups:
            _shut(group)

    # ---- sending ----
    def _send(self, peer: dict[str, Any], runs: list[BlockRun], request_id: str, deadline: Deadline) -> int:
        peer_id = str(peer["id"])
        with self._groups_lock:
            lock = self._pair_locks.setdefault(peer_id, threading.Lock())
        if not lock.acquire(timeout=deadline.left()):
            raise TimeoutError(f"timed out after {deadline.seconds}s behind other transfers to this peer")
        try:
            return super()._send(peer, runs, request_id, deadline)
        except BaseException:
            self._drop_sending(peer_id)  # whatever broke, the next transfer starts a clean group
            raise
        finally:
            lock.release()

    def _payload_fields(self, peer: dict[str, Any]) -> dict[str, Any]:
        pair = self._sending.get(str(peer["id"]))
        new = pair is None
        if pair is None:
            pair = self._sending[str(peer["id"])] = _PairGroup(f"{self.id}/{next(self._generations)}")
        # Both ends split the payload by the sender's piece size: a send and its receive must match.
        return {"group": pair.key, "new": new, "collective": self.collective, "piece_bytes": self.piece_bytes}

    def _send_payload(self, sock: socket.socket, header: dict[str, Any], peer: dict[str, Any],
                      runs: list[BlockRun], spans: list[tuple[int, int]], deadline: Deadline) -> None:
        assert self.kv_cache is not None
        pair = self._sending[str(peer["id"])]
        if pair.group is None:
            store = dist.TCPStore(peer["host"], int(peer["store_port"]), is_master=False,
                                  timeout=timedelta(seconds=deadline.left()))
            pair.group = _new_group(store, pair.key, 0, self.collective, self.host, deadline.left())
            pair.store = store
        src = _block_ids(((r.src_start, r.num_blocks) for r in runs), self.kv_cache.device)
        with _on_device(self.kv_cache):
            for layers in _pieces(self.kv_cache, len(src), self.piece_bytes):
                staging = self.kv_cache[layers].index_select(2, src)
                _finish(pair.group.send([staging], 1, 0), self.collective, deadline.left(), "send")

    def _drop_sending(self, peer_id: str) -> None:
        with self._groups_lock:
            pair = self._sending.pop(peer_id, None)
        if pair is not None and pair.group is not None:
            _shut(pair.group)

    # ---- receiving ----
    def _check_payload(self, header: dict[str, Any]) -> str | None:
        if header["collective"] != self.collective:
            return (f"collective mismatch: the sender's cache uses {header['collective']}, "
                    f"this receiver's {self.collective} (both caches on GPU, or both on CPU)")
        if not header["new"] and header["group"] not in self._receiving:
            return f"unknown pair group {header['group']} (dropped after a failure); the next transfer makes one"
        return None

    def _receive_payload(self, conn: socket.socket, header: dict[str, Any], spans: list[tuple[int, int]]) -> None:
        assert self.kv_cache is not None
        key = header["group"]
        try:
            if header["new"]:
                self._add_receiving(key, _new_group(self._store, key, 1, self.collective, self.host,
                                                    self.read_timeout_s))
            group = self._receiving[key]
            dst = _block_ids(header["runs"], self.kv_cache.device)
            with _on_device(self.kv_cache):
                for layers in _pieces(self.kv_cache, len(dst), int(header["piece_bytes"])):
                    part = self.kv_cache[layers]
                    staging = torch.empty((part.shape[0], 2, len(dst), *part.shape[3:]), dtype=part.dtype,
                                          device=part.device)
                    _finish(group.recv([staging], 0, 0), self.collective, self.read_timeout_s, "receive")
                    part.index_copy_(2, dst, staging)
                if self.kv_cache.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # "done" means the blocks hold the KV
        except (RuntimeError, TimeoutError, KeyError) as e:
            self._drop_receiving(key)
            raise ConnectionError(f"collective receive failed: {e}") from e

    def _add_receiving(self, key: str, group: _Group) -> None:
        sender = key.split("/")[0]
        with self._groups_lock:
            older = [k for k in self._receiving if k.split("/")[0] == sender]
            self._receiving[key] = group
        for k in older:  # the sender dropped its side of these
            self._drop_receiving(k)

    def _drop_receiving(self, key: str) -> None:
        with self._groups_lock:
            group = self._receiving.pop(key, None)
        if group is not None:
            _shut(group)


def _new_group(store: dist.Store, key: str, rank: int, collective: str, host: str,
               timeout_s: float) -> _Group:
    """Rank ``rank`` of a new group of two; blocks until the other rank joins (gloo) or, for NCCL,
    until the first send/recv (NCCL makes its communicator lazily)."""
    prefixed = dist.PrefixStore(f"tandem-kv/{key}/", store)
    timeout = timedelta(seconds=max(timeout_s, 0.001))
    if collective == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (missing from the stubs)
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def _finish(work: dist.Work, collective: str, timeout_s: float, what: str) -> None:
    """Wait for a send or receive, never past the timeout, and raise its error if it failed."""
    if collective == "gloo":
        try:
            work.wait(timedelta(seconds=max(timeout_s, 0.001)))  # gloo honours a wait timeout
        except RuntimeError as e:
            if "timed out" in str(e).lower():
                raise TimeoutError(f"the collective {what} timed out after {timeout_s:.3g}s") from e
            raise
        return
    end = time.monotonic() + timeout_s  # an NCCL wait only orders streams: poll the GPU event instead
    while not work.is_completed():
        if time.monotonic() > end:
            raise TimeoutError(f"the collective {what} timed out after {timeout_s:.3g}s")
        time.sleep(_POLL_S)
    work.wait()  # raises the collective's error, if it failed


def _shut(group: _Group | None) -> None:
    """Abort a group so a peer blocked on it fails now instead of at its timeout."""
    if group is None:
        return
    try:
        group.abort()
    except RuntimeError:
        pass  # already broken, or a backend without abort


def _block_ids(runs: Any, device: torch.device) -> torch.Tensor:
    ids = [b for start, count in runs for b in range(start, start + count)]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _pieces(cache: torch.Tensor, num_blocks: int, piece_bytes: int) -> list[slice]:
    """Layer ranges whose share of the transfer holds at most ``piece_bytes`` (at least one layer)."""
    per_layer = 2 * num_blocks * cache[0, 0, 0].numel() * cache.element_size()
    step = max(1, piece_bytes // max(per_layer, 1))
    return [slice(i, min(i + step, cache.shape[0])) for i in range(0, cache.shape[0], step)]


def _on_device(cache: torch.Tensor) -> Any:
    """Transport threads are new threads: on a GPU, make the cache's device current in them."""
    return torch.cuda.device(cache.device) if cache.device.type == "cuda" else contextlib.nullcontext()
