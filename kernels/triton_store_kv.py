"""Triton kernel: write new tokens' K and V into their paged-cache slots.

Reference: ``kernels.reference.store_kv_ref``. One program per token; slot -1 (padding) is skipped.

    slot = block_id * block_size + offset      k_cache[block_id, offset] = k[token]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, KVH, D], each token's KVH x D row contiguous
    v_ptr,  # [T, KVH, D], likewise
    k_cache_ptr,  # [num_blocks, block_size, KVH, D], contiguous
    v_cache_ptr,  # [num_blocks, block_size, KVH, D], contiguous
    slot_ptr,  # [T] int32/int64, -1 = padding
    stride_k_tok,
    stride_v_tok,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # KVH * D
    ROW_PAD: tl.constexpr,  # next power of two of ROW
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    # int64 throughout: block ids past 2^16 times a row of 2^15 elements overflow int32.
    dst = (slot // BLOCK_SIZE) * (BLOCK_SIZE * ROW) + (slot % BLOCK_SIZE) * ROW
    cols = tl.arange(0, ROW_PAD)
    mask = cols < ROW
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_k_tok + cols, mask=mask)
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_v_tok + cols, mask=mask)
    tl.store(k_cache_ptr + dst + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "each token's K/V row must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        BLOCK_SIZE=k_cache.shape[1], ROW=row, ROW_PAD=next_power_of_2(row),
    )
