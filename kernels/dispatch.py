"""The one entry point for attention: picks a backend per call.

``backend=None`` means Triton for CUDA tensors; on CPU, the compiled decode kernel (``cpu``: the
C++ kernels for decode, prefill and store_kv) where it builds, else torch. The Triton
backend (``kernels.triton_ops``) is imported on first use, once: a machine where Triton can't load
still runs the torch path; so does one where the C++ kernel can't be built.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
from torch import Tensor

from kernels import cpu_kernel, kv_quant, torch_decode, torch_paged

BACKENDS = ("torch", "triton", "cpu")


def resolve_backend(device: torch.device, backend: str | None) -> str:
    if backend is None:
        if device.type == "cuda":
            return "triton" if triton_ops() is not None else "torch"
        return "cpu" if device.type == "cpu" and cpu_kernel.available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs CPU tensors, not {device.type}")
        if not cpu_kernel.available():
            raise ValueError(f"attention backend 'cpu' is not available: {cpu_kernel.unavailable_reason()}")
    if backend == "triton":
        if triton_ops() is None:
            raise ValueError("attention backend 'triton' is not available: Triton kernels failed to import")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' runs CPU tensors only under TRITON_INTERPRET=1")
    return backend


@functools.cache  # one import attempt per process, not one per attention call
def triton_ops() -> ModuleType | None:
    try:
        return importlib.import_module("kernels.triton_ops")
    except ImportError:
        return None


def _triton() -> ModuleType:
    ops = triton_ops()
    assert ops is not None  # resolve_backend checked it
    return ops


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                           scale: float, backend: str | None = None) -> Tensor:
    """See ``torch_decode.paged_decode_attention_torch`` for shapes."""
    chosen = resolve_backend(q.device, backend)
    if chosen == "triton":
        return _triton().paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale
        )
    if chosen == "cpu" and cpu_kernel.supports(q, k_cache):
        return cpu_kernel.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    if k_cache.dtype == kv_quant.INT8:
        raise ValueError(f"an int8 KV cache is read by the compiled CPU attention only (backend {chosen}, "
                         f"queries {q.dtype} {tuple(q.shape)})")
    return torch_decode.paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                            seq_lens: Tensor, *, scale: float, backend: str | None = None,
                            max_query_len: int | None = None) -> Tensor:
    """See ``torch_paged.paged_prefill_attention_torch`` for shapes. ``max_query_len``: the longest
    sequence's query length if the caller knows it (saves Triton a GPU-to-host sync)."""
    chosen = resolve_backend(q.device, backend)
    if chosen == "triton":
        return _triton().paged_prefill_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=scale, max_query_len=max_query_len
        )
    if chosen == "cpu" and cpu_kernel.supports(q, k_cache):
        return cpu_kernel.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                  scale=scale)
    return torch_paged.paged_prefill_attention_torch(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=scale
    )


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             backend: str | None = None) -> None:
    chosen = resolve_backend(k.device, backend)
    if chosen == "triton":
        _triton().store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    if chosen == "cpu":
        cpu_kernel.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    torch_paged.store_kv_torch(k, v, k_cache, v_cache, slot_mapping)
