"""KV transport: moves KV blocks from a prefill worker's cache into a decode worker's cache.

One small interface, several backends: ``tcp`` (always available), ``nixl`` (NIXL agents over UCX),
``nccl`` (torch.distributed send/recv: NCCL between GPUs, gloo between CPU caches). Ownership: a
worker registers its whole KV cache once; a transfer writes source blocks into destination blocks
that the *receiver* reserved beforehand (admission), so the receiver owns them throughout and frees
them if the transfer fails.

Cache layout (one tensor per worker): [layers, 2 (K/V), num_blocks, block_size, kv_heads, head_dim].
A run of consecutive block ids is one contiguous segment per (layer, K/V) slab:

    blocks 5,6,7 -> 8,9,10:   for each layer l, kv j: src[l, j, 5:8]  ->  dst[l, j, 8:11]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class BlockRun(NamedTuple):
    src_start: int
    dst_start: int
    num_blocks: int


def coalesce_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair source and destination blocks into runs that are consecutive on both sides."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("source and destination block lists differ in length")
    runs: list[BlockRun] = []
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if runs and src == runs[-1].src_start + runs[-1].num_blocks and dst == runs[-1].dst_start + runs[-1].num_blocks:
            runs[-1] = runs[-1]._replace(num_blocks=runs[-1].num_blocks + 1)
        else:
            runs.append(BlockRun(src, dst, 1))
    return runs


def check_cache_layout(kv_cache: torch.Tensor) -> None:
    if not kv_cache.is_contiguous() or kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError("register a contiguous [layers, 2, blocks, block_size, kv_heads, head_dim] cache")


class CacheLayout(NamedTuple):
    """What two ends must agree on: layers, and bytes per block in one (layer, K/V) slab."""

    num_layers: int
    num_blocks: int
    slab_block_bytes: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> CacheLayout:
        return cls(kv_cache.shape[0], kv_cache.shape[2], kv_cache[0, 0, 0].numel() * kv_cache.element_size())

    def run_spans(self, start: int, num_blocks: int) -> list[tuple[int, int]]:
        """(byte offset from the cache's start, length) of each contiguous piece of a block run, in wire
        order (layer-major, then K, V). Plain arithmetic: a transfer of scattered blocks has thousands."""
        slab = self.num_blocks * self.slab_block_bytes
        first, length = start * self.slab_block_bytes, num_blocks * self.slab_block_bytes
        return [(i * slab + first, length) for i in range(self.num_layers * 2)]


def layout_error(receiver: CacheLayout | None, sender: CacheLayout, dst_runs: Sequence[tuple[int, int]]) -> str | None:
    """Why ``receiver`` cannot take these runs (``(dst_start, count)``) from ``sender``, or None."""
    if receiver is None:
        return "no KV cache registered on the receiving side"
    if (sender.num_layers, sender.slab_block_bytes) != (receiver.num_layers, receiver.slab_block_bytes):
        return (f"KV layout mismatch: sender has {sender.num_layers} layers x {sender.slab_block_bytes} bytes "
                f"per block slab, receiver {receiver.num_layers} x {receiver.slab_block_bytes}")
    for dst_start, count in dst_runs:
        if dst_start < 0 or count <= 0 or dst_start + count > receiver.num_blocks:
            return f"destination blocks {dst_start}..{dst_start + count - 1} outside 0..{receiver.num_blocks - 1}"
    return None


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    num_bytes: int
    seconds: float


class KVTransport(ABC):
    """One worker's end of the KV transport.

    ``address()`` is plain data (msgpack-able) that peers pass to ``write_blocks``.
    """

    backend: str

    @abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None:
        """Expose this worker's cache (contiguous) as a transfer source and destination."""

    @abstractmethod
    def address(self) -> dict[str, Any]:
        """How a peer reaches this worker's registered cache."""

    @abstractmethod
    def write_blocks(self, peer: dict[str, Any], src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                     request_id: str, timeout_s: float) -> TransferResult:
        """Copy local blocks into the peer's blocks; returns once the peer holds them.

        Raises ``TransferError`` on failure or after ``timeout_s``: nothing hangs.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release sockets or agents."""
