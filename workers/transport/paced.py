"""A transport that takes the profiled time of the real model's KV bytes: the timing-model worker's.

    transport = PacedTransport(make_transport("tcp"), profile, block_size=16)

The blocks of a timing model hold 8 bytes a token (``workers.model.timing_model``); the inner transport
moves those for real (the same connections, headers, block lists and failures), then the write waits
until the profile's transfer time for ``blocks x block_size x kv_bytes_per_token`` has passed, and
reports those bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.protocol.timing_profile import TimingProfile
from workers.transport.base import KVTransport, TransferResult


class PacedTransport(KVTransport):
    def __init__(self, inner: KVTransport, profile: TimingProfile, block_size: int,
                 sleep: Callable[[float], None] = time.sleep):
        self.inner = inner
        self.backend = inner.backend
        self.profile = profile
        self.block_size = block_size
        self._sleep = sleep

    def register(self, kv_cache: torch.Tensor) -> None:
        self.inner.register(kv_cache)

    def address(self) -> dict[str, Any]:
        return self.inner.address()

    def write_blocks(self, peer: dict[str, Any], src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                     request_id: str, timeout_s: float) -> TransferResult:
        started = time.perf_counter()
        self.inner.write_blocks(peer, src_block_ids, dst_block_ids, request_id, timeout_s)
        num_bytes = len(src_block_ids) * self.block_size * self.profile.kv_bytes_per_token
        self._sleep(max(0.0, self.profile.transfer_s(num_bytes) - (time.perf_counter() - started)))
        return TransferResult(request_id, num_bytes, time.perf_counter() - started)

    def close(self) -> None:
        self.inner.close()
