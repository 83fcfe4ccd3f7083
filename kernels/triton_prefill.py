"""Triton paged prefill attention: packed variable-length queries over a paged KV cache.

Reference: ``kernels.reference.paged_prefill_attention_ref``. Covers chunked prefill and prefix-cache
hits: sequence s's queries are its *last* q_len tokens, and its first seq_len - q_len tokens are
already in the cache.

Grid (query tile, seq, head); FlashAttention-2 online softmax over key tiles, causal:

    keys:     0 .............. ctx ........... seq_len
    queries:                   |<--- q_len --->|
    query i (position ctx + i) sees keys 0..ctx+i; the tile stops at its last query's position.

A query tile's key loop has two phases: tiles every one of its queries sees in full (no mask work),
then the tiles on the diagonal (masked). Programs take query tiles last-first, so the longest
(diagonal-most) ones start first and short ones fill the tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.triton_tiles import LOG2E, online_softmax_update, tile_scores


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D], sequences packed
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_tables_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [T, H, D]
    scale,  # softmax scale times log2(e)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    kvh = head // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < q_len
    d = tl.arange(0, HEAD_DIM)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_ok[:, None], other=0.0)
    q_pos = ctx + m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    # Phase 1: keys before the tile's first query position, seen by every row.
    full_end = (ctx + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < full_end  # all true (unused: MASKED=False)
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        row = (n % BLOCK_SIZE).to(tl.int64)
        s = tile_scores(q, k_cache_ptr, blk, row, kvh, stride_kb, stride_kt, stride_kh, d, n_ok, IEEE=IEEE,
                        MASKED=False) * scale
        m_i, l_i, acc = online_softmax_update(s, m_i, l_i, acc, v_cache_ptr, blk, row, kvh, stride_vb, stride_vt,
                                              stride_vh, d, n_ok, IEEE=IEEE, MASKED=False)
    # Phase 2: the diagonal, up to the tile's last query position.
    hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
    for n0 in range(full_end, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = (n % BLOCK_SIZE).to(tl.int64)
        s = tile_scores(q, k_cache_ptr, blk, row, kvh, stride_kb, stride_kt, stride_kh, d, n_ok, IEEE=IEEE)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_update(s, m_i, l_i, acc, v_cache_ptr, blk, row, kvh, stride_vb, stride_vt,
                                              stride_vh, d, n_ok, IEEE=IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    max_query_len: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Defaults from a sweep on an H100 (bf16, head_dim 128, prompts of 512 to 4,096 tokens): 64x64 tiles,
    4 warps, 4 pipeline stages for 16-bit caches (3 for fp32, whose tiles are twice the bytes)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim == next_power_of_2(head_dim) and head_dim >= 16, "head_dim must be a power of 2 >= 16"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # a GPU-to-host sync
    if num_stages is None:
        num_stages = 3 if q.dtype == torch.float32 else 4
    grid = (cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out
