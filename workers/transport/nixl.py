"""``nixl`` KV transport: a NIXL agent over UCX (RDMA, NVLink, shared memory or TCP, as UCX finds).

What Dynamo, vLLM and SGLang use for disaggregated KV. Each worker's agent registers its whole cache
once; ``address()`` carries the agent's metadata (its UCX endpoints and memory keys) plus where the
cache lives, so a sender can load it and post one one-sided WRITE of every (run, layer, K/V) segment
straight into the receiver's memory. The receiver's CPU takes no part in the copy.

Host caches (``DRAM``) are written through lanes: a sender keeps extra agents (each its own UCX
worker) and posts a large transfer as byte-balanced parts, one per lane, from threads side by side
(``workers.transport.copy_lanes``: one lane reaches ~0.6x a memcpy here, two ~0.8-0.9x). GPU memory takes one
lane: there the copy engines or the NIC do the work, not the posting thread.

A WRITE that reports DONE has been flushed to the target, so when ``write_blocks`` returns the
receiver holds the bytes. The ``nixl-cu12`` wheel moves CPU memory as well (``DRAM``), which is how
this backend is tested without a GPU.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from workers.protocol.errors import TransferError
from workers.transport.base import (
    CacheLayout,
    KVTransport,
    TransferResult,
    check_cache_layout,
    coalesce_runs,
    layout_error,
)
from workers.transport.copy_lanes import LANES, PARALLEL_MIN_BYTES, run_on_lanes, split_by_bytes

_PROGRESS_INTERVAL_S = 0.001


def nixl_available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def _nixl() -> Any:
    try:
        import nixl_cu12
    except ImportError as e:
        raise TransferError("the nixl backend needs the nixl-cu12 package (pip install nixl-cu12)") from e
    return nixl_cu12


class _Lane:
    """One NIXL agent (its own UCX worker) and the lock that keeps its calls serial: the Python
    wrapper keeps state of its own."""

    def __init__(self, nixl: Any, name: str):
        # NIXL's own progress thread busy-polls (no delay between passes): an idle agent burns a whole
        # core, which on a small CPU host halves the prefill next to it. A 1 ms progress loop of
        # ours costs ~4% of a core and moved 64 MiB faster here (a sender also progresses while it
        # polls its transfer).
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self.agent = nixl.nixl_agent(name, config)
        self.lock = threading.Lock()
        self.remote_agents: set[str] = set()
        self.registered: Any = None

    def transfer(self, peer: dict[str, Any], local: np.ndarray, remote: np.ndarray, local_mem: str,
                 notif: str, deadline: float, timeout_s: float) -> None:
        handle = self._post(peer, local, remote, local_mem, notif)
        try:
            self._wait(handle, peer, notif, deadline, timeout_s)
        finally:
            self._release(handle)

    def close(self) -> None:
        with self.lock:
            for agent in self.remote_agents:
                self.agent.remove_remote_agent(agent)
            self.remote_agents.clear()
            if self.registered is not None:
                self.agent.deregister_memory(self.registered)
                self.registered = None

    def _post(self, peer: dict[str, Any], local: np.ndarray, remote: np.ndarray, local_mem: str, notif: str) -> Any:
        with self.lock:
            try:
                if peer["agent"] not in self.remote_agents:
                    self.remote_agents.add(self.agent.add_remote_agent(peer["metadata"]))
                handle = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs(local, local_mem),
                    self.agent.get_xfer_descs(remote, peer["mem"]), peer["agent"], notif.encode())
                state = self.agent.transfer(handle)
            except Exception as e:  # nixl raises its bindings' own error types
                raise TransferError(f"transfer {notif} to {peer.get('agent')} failed: "
                                    f"{type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"transfer {notif} to {peer.get('agent')} failed to post")
        return handle

    def _wait(self, handle: Any, peer: dict[str, Any], notif: str, deadline: float, timeout_s: float) -> None:
        pause = 0.0
        while True:
            with self.lock:
                state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state == "ERR":
                self._forget_peer(peer)
                raise TransferError(f"transfer {notif} to {peer.get('agent')} failed (peer gone?)")
            if time.perf_counter() > deadline:
                self._forget_peer(peer)
                raise TransferError(f"transfer {notif} to {peer.get('agent')} timed out after {timeout_s}s")
            # Spin briefly (small transfers finish in microseconds), then back off to spare the CPU.
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)

    def _release(self, handle: Any) -> None:
        with self.lock:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle stuck in flight stays with the agent; nothing to do
                pass

    def _forget_peer(self, peer: dict[str, Any]) -> None:
        """Drop a failed peer's endpoints, so a restarted worker under that name is reloaded."""
        with self.lock:
            if peer["agent"] in self.remote_agents:
                self.remote_agents.discard(peer["agent"])
                try:
                    self.agent.remove_remote_agent(peer["agent"])
                except Exception:  # noqa: BLE001 - already torn down by UCX
                    pass


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(self, name: str | None = None, device: str = "cpu", lanes: int | None = None):
        nixl = _nixl()
        if device == "cpu":
            # Host memory between processes: cross-memory attach (one kernel copy) beats UCX's default
            # pick (TCP loopback) ~1.4x here; tcp stays for peers on other nodes. An operator's
            # UCX_TLS wins; GPU caches leave the choice to UCX (NVLink, RDMA, cuda_ipc).
            os.environ.setdefault("UCX_TLS", "cma,tcp,self")
        self.name = name or f"tandem-{uuid.uuid4().hex[:12]}"
        num_lanes = lanes if lanes is not None else (LANES if device == "cpu" else 1)
        # Lane 0 is the agent peers write into (its name is the address); the others only send.
        self._lanes = [_Lane(nixl, self.name)] + [_Lane(nixl, f"{self.name}-lane{i}") for i in range(1, num_lanes)]
        self.kv_cache: torch.Tensor | None = None
        self._closed = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress, name=f"{self.name}-progress", daemon=True)
        self._progress_thread.start()

    def _progress(self) -> None:
        """Serve peers' connection set-up and writes into our memory (UCX needs the target to progress)."""
        lane = self._lanes[0]
        while not self._closed.wait(_PROGRESS_INTERVAL_S):
            with lane.lock:
                lane.agent.get_new_notifs()

    # ---- KVTransport ----
    def register(self, kv_cache: torch.Tensor) -> None:
        check_cache_layout(kv_cache)
        for lane in self._lanes:
            with lane.lock:
                lane.registered = lane.agent.register_memory([kv_cache])
        self.kv_cache = kv_cache

    def address(self) -> dict[str, Any]:
        if self.kv_cache is None:
            raise TransferError("no KV cache registered")
        cache = self.kv_cache
        return {
            "backend": self.backend, "agent": self.name, "metadata": self._lanes[0].agent.get_agent_metadata(),
            "base": cache.data_ptr(), "device_id": max(cache.get_device(), 0), "mem": _mem_type(cache),
            "layout": list(CacheLayout.of(cache)),
        }

    def write_blocks(self, peer: dict[str, Any], src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                     request_id: str, timeout_s: float) -> TransferResult:
        if self.kv_cache is None:
            raise TransferError("no KV cache registered on the sending side")
        runs = coalesce_runs(src_block_ids, dst_block_ids)
        error = layout_error(CacheLayout(*peer["layout"]), CacheLayout.of(self.kv_cache),
                             [(r.dst_start, r.num_blocks) for r in runs])
        if error is not None:
            raise TransferError(f"transfer {request_id} to {peer.get('agent')} refused: {error}")
        local, remote = self._descriptors(peer, runs)
        num_bytes = int(local[:, 1].sum())
        parts = self._split(local, remote) if len(self._lanes) > 1 and num_bytes >= PARALLEL_MIN_BYTES else [
            (local, remote)]
        t0 = time.perf_counter()
        mem = _mem_type(self.kv_cache)
        run_on_lanes([partial(self._lanes[i].transfer, peer, part_local, part_remote, mem,
                              request_id if len(parts) == 1 else f"{request_id}/lane{i}", t0 + timeout_s, timeout_s)
                      for i, (part_local, part_remote) in enumerate(parts)], name=f"{self.name}-lane")
        return TransferResult(request_id, num_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._closed.set()
        self._progress_thread.join(timeout=5)
        for lane in self._lanes:
            lane.close()

    # ---- internals ----
    def _descriptors(self, peer: dict[str, Any], runs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(address, length, device) rows for every run's (layer, K/V) segment, on both sides."""
        assert self.kv_cache is not None
        cache = self.kv_cache
        layers, _, block_bytes = CacheLayout.of(cache)
        slabs = np.arange(layers * 2, dtype=np.uint64)  # slab index = layer * 2 + K/V
        rows_local, rows_remote = [], []
        for run in runs:
            length = np.full_like(slabs, run.num_blocks * block_bytes)
            src = cache.data_ptr() + (slabs * cache.shape[2] + run.src_start) * block_bytes
            dst = int(peer["base"]) + (slabs * int(peer["layout"][1]) + run.dst_start) * block_bytes
            rows_local.append(np.stack([src, length, np.full_like(slabs, max(cache.get_device(), 0))], axis=1))
            rows_remote.append(np.stack([dst, length, np.full_like(slabs, int(peer["device_id"]))], axis=1))
        return np.concatenate(rows_local), np.concatenate(rows_remote)

    def _split(self, local: np.ndarray, remote: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The descriptor rows cut into one byte-balanced part per lane (both sides cut alike)."""
        table = np.stack([local[:, 0], remote[:, 0], local[:, 1]], axis=1)
        parts = []
        for part in split_by_bytes(table, len(self._lanes)):
            n = len(part)
            parts.append((np.stack([part[:, 0], part[:, 2], np.full(n, local[0, 2], np.uint64)], axis=1),
                          np.stack([part[:, 1], part[:, 2], np.full(n, remote[0, 2], np.uint64)], axis=1)))
        return parts


def _mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"
