"""Splitting one large host-to-host copy into lanes that run on threads side by side.

On this class of host a single copying thread into another process stops at ~0.6x a memcpy
(the kernel pins and maps the peer's pages as it goes: process_vm_writev, and UCX's cross-memory
transport on top of it); two threads, each with half the bytes, reach ~0.9-1.0x. The same-host
tcp path and the nixl backend both split their copies this way. Small copies stay on one lane.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

LANES = 2
PARALLEL_MIN_BYTES = 4 << 20

T = TypeVar("T")


def split_by_bytes(table: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` tables of about equal bytes from rows ``(src, dst, length)`` (uint64; src and dst are
    addresses or offsets). A row crossing a cut is split there; empty parts are dropped."""
    starts = np.concatenate([[0], np.cumsum(table[:, 2])]).astype(np.uint64)
    total = int(starts[-1])
    parts = []
    for k in range(n):
        lo, hi = total * k // n, total * (k + 1) // n
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        part = table[first:last].copy()
        if len(part) == 0:
            continue
        head = np.uint64(lo) - starts[first]  # bytes of the first row that belong to the previous part
        part[0, 0] += head
        part[0, 1] += head
        part[0, 2] -= head
        part[-1, 2] -= starts[last] - np.uint64(hi)  # bytes of the last row that belong to the next part
        parts.append(part[part[:, 2] > 0])
    return [p for p in parts if len(p)]


def run_on_lanes(calls: Sequence[Callable[[], T]], name: str = "copy-lane") -> list[T]:
    """Run ``calls[0]`` here and the rest on threads of their own; wait for all, then re-raise the
    first error in the caller's thread (every lane has finished by then: nothing is left writing)."""
    results: list[T | BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = e

    helpers = [threading.Thread(target=run, args=(i,), name=name, daemon=True) for i in range(1, len(calls))]
    for t in helpers:
        t.start()
    run(0)
    for t in helpers:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]
