"""``nixl`` KV transport: a NIXL agent over UCX (RDMA, NVLink, shared memory or TCP, as UCX finds).

What Dynamo, vLLM and SGLang use for disaggregated KV. Each worker's agent registers its whole cache
once; ``address()`` carries the agent's metadata (its UCX endpoints and memory keys) plus where the
cache lives, so a sender can load it and post one one-sided WRITE of every (run, layer, K/V) segment
straight into the receiver's memory. The receiver's CPU takes no part in the copy.

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
from typing import Any

import numpy as np
import torch

from workers.kv_transport import (
    CacheLayout,
    KVTransport,
    TransferError,
    TransferResult,
    check_cache_layout,
    coalesce_runs,
    layout_error,
)

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


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(self, name: str | None = None, device: str = "cpu"):
        nixl = _nixl()
        if device == "cpu":
            # Host memory between processes: cross-memory attach (one kernel copy) beats UCX's default
            # pick (TCP loopback) ~1.4x here; tcp stays for peers on other nodes. An operator's
            # UCX_TLS wins; GPU caches leave the choice to UCX (NVLink, RDMA, cuda_ipc).
            os.environ.setdefault("UCX_TLS", "cma,tcp,self")
        self.name = name or f"tandem-{uuid.uuid4().hex[:12]}"
        # NIXL's own progress thread busy-polls (no delay between passes): an idle agent burns a whole
        # core, which on a small CPU host halves the prefill next to it. A 1 ms progress loop of
        # ours costs ~4% of a core and moved 64 MiB faster here (the sender also progresses while it
        # polls its transfer).
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl.nixl_agent(self.name, config)
        self._lock = threading.Lock()  # the Python wrapper keeps state of its own; calls stay serial
        self._remote_agents: set[str] = set()
        self._registered: Any = None
        self.kv_cache: torch.Tensor | None = None
        self._closed = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress, name=f"{self.name}-progress", daemon=True)
        self._progress_thread.start()

    def _progress(self) -> None:
        """Serve peers' connection set-up and writes into our memory (UCX needs the target to progress)."""
        while not self._closed.wait(_PROGRESS_INTERVAL_S):
            with self._lock:
                self._agent.get_new_notifs()

    # ---- KVTransport ----
    def register(self, kv_cache: torch.Tensor) -> None:
        check_cache_layout(kv_cache)
        with self._lock:
            self._registered = self._agent.register_memory([kv_cache])
        self.kv_cache = kv_cache

    def address(self) -> dict[str, Any]:
        if self.kv_cache is None:
            raise TransferError("no KV cache registered")
        cache = self.kv_cache
        return {
            "backend": self.backend, "agent": self.name, "metadata": self._agent.get_agent_metadata(),
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
        t0 = time.perf_counter()
        handle = self._post(peer, local, remote, request_id)
        try:
            self._wait(handle, peer, request_id, t0 + timeout_s, timeout_s)
        finally:
            self._release(handle)
        return TransferResult(request_id, int(local[:, 1].sum()), time.perf_counter() - t0)

    def close(self) -> None:
        self._closed.set()
        self._progress_thread.join(timeout=5)
        with self._lock:
            for agent in self._remote_agents:
                self._agent.remove_remote_agent(agent)
            self._remote_agents.clear()
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
                self._registered = None

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

    def _post(self, peer: dict[str, Any], local: np.ndarray, remote: np.ndarray, request_id: str) -> Any:
        assert self.kv_cache is not None
        with self._lock:
            try:
                if peer["agent"] not in self._remote_agents:
                    self._remote_agents.add(self._agent.add_remote_agent(peer["metadata"]))
                handle = self._agent.initialize_xfer(
                    "WRITE", self._agent.get_xfer_descs(local, _mem_type(self.kv_cache)),
                    self._agent.get_xfer_descs(remote, peer["mem"]), peer["agent"], request_id.encode())
                state = self._agent.transfer(handle)
            except Exception as e:  # nixl raises its bindings' own error types
                raise TransferError(f"transfer {request_id} to {peer.get('agent')} failed: "
                                    f"{type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"transfer {request_id} to {peer.get('agent')} failed to post")
        return handle

    def _wait(self, handle: Any, peer: dict[str, Any], request_id: str, deadline: float, timeout_s: float) -> None:
        pause = 0.0
        while True:
            with self._lock:
                state = self._agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state == "ERR":
                self._forget_peer(peer)
                raise TransferError(f"transfer {request_id} to {peer.get('agent')} failed (peer gone?)")
            if time.perf_counter() > deadline:
                self._forget_peer(peer)
                raise TransferError(f"transfer {request_id} to {peer.get('agent')} timed out after {timeout_s}s")
            # Spin briefly (small transfers finish in microseconds), then back off to spare the CPU.
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)

    def _release(self, handle: Any) -> None:
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle stuck in flight stays with the agent; nothing to do
                pass

    def _forget_peer(self, peer: dict[str, Any]) -> None:
        """Drop a failed peer's endpoints, so a restarted worker under that name is reloaded."""
        with self._lock:
            if peer["agent"] in self._remote_agents:
                self._remote_agents.discard(peer["agent"])
                try:
                    self._agent.remove_remote_agent(peer["agent"])
                except Exception:  # noqa: BLE001 - already torn down by UCX
                    pass


def _mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"
