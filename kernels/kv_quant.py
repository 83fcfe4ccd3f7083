"""The int8 KV cache's rows: each head's D values quantized symmetrically, then their scale.

    rows = quantize_rows(k)          # [..., D] fp32 -> [..., D + 4] int8
    k_approx = dequantize_rows(rows)  # -> [..., D] fp32

A head row is D int8 values ``q = round(x / scale)`` (to nearest even, within +-127) with
``scale = max|x| / 127``, then the scale's 4 bytes (fp32). Keeping the scale inside the row keeps a
cache block one run of bytes, so the KV transports, the prefix cache and block copies move it as
they move fp16 blocks; a row of 64 values is 68 bytes (fp16: 128). This is the torch reference of
``kernels/csrc/paged_decode_cpu.cpp``'s ``quantize_head_row`` (the same bits), and the prefill path's
dequantization.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4  # an fp32 scale at the end of every int8 head row
INT8 = torch.int8


def head_row(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one head's row in a cache of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == INT8 else head_dim


def head_dim_of(cache: Tensor) -> int:
    """The head size of a cache [..., KVH, row]."""
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == INT8 else cache.shape[-1]


def quantize_rows(x: Tensor) -> Tensor:
    """[..., D] float -> [..., D + 4] int8 (a row of zeros: zeros and scale 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, (x / scale).clamp(-127.0, 127.0).round(), torch.zeros_like(x))
    return torch.cat([q.to(INT8), scale.contiguous().view(INT8)], dim=-1)


def dequantize_rows(rows: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[..., D + 4] int8 -> [..., D] of ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)
