"""How many KV blocks an engine gets: a count, a byte size, or by default a share of the free memory.

    host (CPU):   share x MemAvailable at start      (several workers share one host: 0.1 by default)
    GPU (CUDA):   share x free device memory after the weights are loaded            (0.8 by default)

``describe`` says in one line what was taken and how many tokens it holds.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from workers.engine.config import EngineConfig

DEFAULT_MEMORY_FRACTION = {"cpu": 0.1, "cuda": 0.8}


class KVCacheSize(NamedTuple):
    num_blocks: int
    how: str  # how the size was chosen, for the start-up line


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_size(config: EngineConfig, bytes_per_block: int, device: torch.device) -> KVCacheSize:
    if config.num_kv_blocks is not None:
        return KVCacheSize(config.num_kv_blocks, "num_kv_blocks")
    if config.kv_cache_bytes is not None:
        return KVCacheSize(config.kv_cache_bytes // bytes_per_block, f"kv_cache_bytes {_gib(config.kv_cache_bytes)}")
    fraction = config.kv_cache_memory_fraction
    if fraction is None:
        fraction = DEFAULT_MEMORY_FRACTION.get(device.type, 0.1)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    free = free_memory_bytes(device)
    return KVCacheSize(int(free * fraction) // bytes_per_block,
                       f"{fraction:.0%} of {_gib(free)} free {'GPU' if device.type == 'cuda' else 'host'} memory")


def describe(size: KVCacheSize, block_size: int, bytes_per_block: int) -> str:
    """What the KV cache took and what it holds, in one line (printed at start; ``tandem serve`` shows it
    beside each worker's readiness)."""
    return (f"KV cache {_gib(size.num_blocks * bytes_per_block)} ({size.how}): {size.num_blocks:,} blocks of "
            f"{block_size} = {size.num_blocks * block_size:,} tokens")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
