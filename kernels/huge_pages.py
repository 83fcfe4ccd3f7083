"""CPU tensors in memory backed by transparent huge pages: copies of the weights a decode step streams, and
the zeroed paged KV cache it reads block by block.

    data = huge_page_copies([w.data for w in weights])   # same values, one 2 MB-aligned mapping
    kv = huge_page_zeros(shape, torch.int8)              # torch.zeros(shape, dtype=...), in huge pages

A batch-1 decode step reads every weight once. From 4 KB pages each page is a TLB miss and a place where
the hardware prefetcher stops. Measured on a 2-core Zen 5 VM at ~48 GB/s: 221 MB of random Q4_1 blocks of
gate_up's shape streamed through the kernel at ~25 GB/s on one core from 4 KB pages and ~36 from 2 MB pages;
the default model's own 66 MB of layer matrices 1.12x faster on one core and 1.05x on two, its decode step
1.05x faster at batch 8 and no faster at batch 1 (``tests/bench/bench_huge_pages.py``). The KV cache's blocks
lie anywhere in it: on a 2-core AVX2 EPYC, 30 layers' decode attention over scattered blocks ran 0.92-0.94x
the time from 2 MB pages (batch 20 of 560 tokens, batch 8 of 1,500; the same cache in both, alternated).
Linux backs anonymous memory with huge pages where THP is "always", or "madvise" (Debian's and Ubuntu's
default) and the range is advised MADV_HUGEPAGE, as here. Where THP is "never", or off Linux, the copies
are plain memory: the same values, read as before. ``TANDEM_HUGE_PAGES=0`` makes plain tensors everywhere
(A/B benchmarks).
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
ALIGN = 64  # each copy starts on a cache line, as the kernels' loads prefer
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_copies(tensors: list[Tensor]) -> list[Tensor]:
    """Contiguous copies of these CPU tensors, packed into one anonymous mapping advised for huge pages. The
    copies keep the mapping alive; the originals can be dropped."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    if total == 0 or not _enabled():
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    whole = _advised_bytes(total)
    copies = []
    for t, size, offset in zip(tensors, sizes, offsets, strict=True):
        view = whole[offset: offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies.append(view)
    return copies


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zeroed CPU tensor in its own mapping advised for huge pages: what torch.zeros gives, for a buffer read
    at scattered places, as the paged KV cache is (each block a step visits was another 4 KB page, another TLB
    miss)."""
    size = math.prod(shape) * dtype.itemsize
    if size == 0 or not _enabled():
        return torch.zeros(shape, dtype=dtype)
    zeros = _advised_bytes(size).view(dtype).view(shape)
    # Written now, as torch.zeros writes: every page is taken (or refused) at start, not at a step mid-run.
    return zeros.zero_()


def _enabled() -> bool:
    return os.environ.get("TANDEM_HUGE_PAGES") != "0"


def _advised_bytes(total: int) -> Tensor:
    """``total`` bytes (uint8) starting on a 2 MB boundary, in an anonymous mapping advised for huge pages; the
    tensor and its views hold the mapping for as long as any of them lives."""
    # One huge page more than needed: the mapping's start need not be 2 MB-aligned, and only aligned 2 MB
    # ranges can become huge pages.
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start: start + total]


def transparent_huge_pages() -> str:
    """The kernel's THP setting ("always", "madvise" or "never"), or "unknown" where it does not say."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"
