"""Triton building blocks shared by the decode and prefill kernels (inlined into each).

One tile = BLOCK_N key positions of one sequence and one KV head, gathered through the block table:
``blk`` [BLOCK_N] holds each position's block id (int64), ``row`` its row inside the block.

Scores are kept in the log2 domain (``q·k * scale * log2(e)``) so the softmax uses ``exp2``, one
instruction on NVIDIA GPUs where ``exp`` costs a multiply more; log-sum-exps are base 2 as well.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # callers scale scores by scale * LOG2E


@triton.jit
def tile_scores(
    q,  # [M, D] query rows (already loaded)
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    blk, row, kvh, stride_kb, stride_kt, stride_kh, d, n_ok,
    IEEE: tl.constexpr,
    MASKED: tl.constexpr = True,  # False: every position of the tile is real (no load masks)
):
    """q @ K^T for one tile: [M, BLOCK_N] (unmasked; padded positions load zeros)."""
    k_ptrs = k_cache_ptr + (blk * stride_kb + row * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        k = tl.load(k_ptrs)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def online_softmax_update(
    s,  # [M, BLOCK_N] scores in the log2 domain, -inf where a key is not visible
    m_i, l_i, acc,  # running max [M], sum [M], output accumulator [M, D] (fp32)
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    blk, row, kvh, stride_vb, stride_vt, stride_vh, d, n_ok,
    IEEE: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """Fold one tile into the running softmax (FlashAttention's rescaling); returns (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that sees no key yet keeps a finite pivot (its result is masked or dropped later).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_cache_ptr + (blk * stride_vb + row * stride_vt + kvh * stride_vh)[:, None] + d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
