"""Triton paged decode attention, split-KV (flash-decoding): one query token per sequence.

Reference: ``kernels.reference.paged_decode_attention_ref``.

Phase 1, grid (seq, kv_head, split): the program loads its KV head's K/V tiles once for the whole
query-head group (GQA) and runs an online softmax over its slice of the sequence, writing a
normalized partial output and its log-sum-exp. Phase 2, grid (seq, head): merges the splits. Each
sequence divides its own length among the splits, in whole tiles of BLOCK_N:

    sequence of 100 tokens, 2 splits:   split 0: tokens 0..63   split 1: tokens 64..99
    sequence of 20 tokens, 2 splits:    split 0: tokens 0..19   split 1: none (lse -inf, weight 0)
    out = sum_s 2^(lse_s - LSE) * out_s,     LSE = log2 sum_s 2^lse_s   (base 2: see triton_tiles)

Key positions in a tile map to cache rows through the block table (block_size 16):
    position n -> block_tables[seq, n // 16], row n % 16
so a tile may span several blocks, in any order in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, multiprocessor_count, next_power_of_2
from kernels.triton_tiles import LOG2E, online_softmax_update, tile_scores

BLOCK_N = 32  # key positions per tile


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    part_out_ptr,  # [B, H, S, D] float32, each split's normalized output
    part_lse_ptr,  # [B, H, S] float32, each split's log2-sum-exp2 (-inf if empty)
    scale,  # softmax scale times log2(e)
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,  # exact fp32 dot (fp32 caches), else tensor-core precision
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence cuts its own length into the splits (whole tiles each): the launch needs no length
    # from the host, so a wide block table (a CUDA graph's) costs no parallelism.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    head_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        blk = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = (n % BLOCK_SIZE).to(tl.int64)
        s = tile_scores(q, k_cache_ptr, blk, row, kvh, stride_kb, stride_kt, stride_kh, d, n_ok, IEEE=IEEE)
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_i, l_i, acc = online_softmax_update(s, m_i, l_i, acc, v_cache_ptr, blk, row, kvh, stride_vb, stride_vt,
                                              stride_vh, d, n_ok, IEEE=IEEE)

    has_tokens = l_i > 0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD] index into [B, H, S]
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=head_ok[:, None])
    tl.store(part_lse_ptr + part, lse, mask=head_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # [B, H, S, D] float32
    part_lse_ptr,  # [B, H, S] float32
    out_ptr,  # [B, H, D]
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds token 0, so the max is finite
    w = w / tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < NUM_SPLITS)[:, None],
                    other=0.0)
    out = tl.sum(w[:, None] * parts, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                      block_n: int = BLOCK_N) -> int:
    """Enough programs to fill the GPU (about 4 per SM) without tiles shorter than ``block_n``."""
    if device.type == "cuda":
        target = 4 * multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 8  # the interpreter: few programs, quick tests
    splits = max(1, target // max(1, num_seqs * num_kv_heads))
    return max(1, min(splits, cdiv(max_tokens, block_n)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim == next_power_of_2(head_dim) and head_dim >= 16, "head_dim must be a power of 2 >= 16"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    group = num_heads // num_kv_heads
    # The block table's width bounds every sequence: no host sync on seq_lens. A split past a short
    # sequence's end finds no tokens (its log-sum-exp is -inf and the merge gives it no weight).
    max_tokens = block_tables.shape[1] * block_size
    splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, max_tokens, q.device, block_n)
    part_out = torch.empty(num_seqs, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(num_seqs, num_heads, splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_SPLITS=splits, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=splits, SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=head_dim,
    )
    return out
