"""Vectorized torch path of paged prefill attention and KV stores: the CPU path where the compiled kernels
(``kernels/csrc/paged_prefill_cpu.cpp``) do not build, and the reference they are tested against (decode is in
``kernels.torch_decode``).

No Python loop over sequences: K/V are gathered through the block tables for a whole group of
sequences of similar length (``length_groups``) and one ``scaled_dot_product_attention`` call does
the group, with a mask for lengths and causality.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import kv_quant
from kernels.host_math import cdiv
from kernels.length_groups import length_groups


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache: [num_blocks, bs, KVH, D], block_tables: [B, M] -> [B, KVH, L, D] (L = max_len rounded up)."""
    block_size = cache.shape[1]
    num_blocks = cdiv(max_len, block_size)
    batch = block_tables.shape[0]
    # index_select on a 2-D view copies whole blocks; 3-4x faster than advanced indexing on CPU.
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    gathered = torch.index_select(cache.view(cache.shape[0], -1), 0, ids)  # [B * nb, bs * KVH * D]
    return gathered.view(batch, num_blocks * block_size, *cache.shape[2:]).transpose(1, 2)


def _widen(rows: Tensor, dtype: torch.dtype) -> Tensor:
    return kv_quant.dequantize_rows(rows, dtype) if rows.dtype == kv_quant.INT8 else rows.to(dtype)


def paged_prefill_attention_torch(
    q: torch.Tensor,  # [T, H, D], sequences packed
    k_cache: torch.Tensor,  # [num_blocks, bs, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, bs, KVH, D]
    block_tables: torch.Tensor,  # [S, M] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    *,
    scale: float,
) -> torch.Tensor:
    groups = length_groups(seq_lens.tolist())
    if len(groups) == 1:
        return _prefill_group(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for group in groups:
        rows = torch.cat([torch.arange(starts[s], starts[s + 1], device=q.device) for s in group])
        q_lens = torch.tensor([starts[s + 1] - starts[s] for s in group], device=q.device)
        group_qsl = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(query_start_loc.dtype)
        idx = torch.tensor(group, device=q.device)
        out[rows] = _prefill_group(q[rows], k_cache, v_cache, block_tables[idx], group_qsl, seq_lens[idx], scale)
    return out


def _prefill_group(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                   seq_lens: Tensor, scale: float) -> Tensor:
    num_seqs = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_q = int(q_lens.max())
    max_len = int(seq_lens.max())
    # A cache narrower than q (fp16 or int8 under fp32 activations) is widened after the gather: only the rows read.
    k = _widen(_gather_kv(k_cache, block_tables, max_len), q.dtype)  # [S, KVH, L, D]
    v = _widen(_gather_kv(v_cache, block_tables, max_len), q.dtype)
    # Pad queries to [S, max_q]: row i of sequence s is packed row start_s + i.
    rows = torch.arange(max_q, device=q.device)
    is_real = rows < q_lens.unsqueeze(1)  # [S, max_q]
    if num_seqs == 1:
        q_pad = q.unsqueeze(0)
    else:
        src = (query_start_loc[:-1].unsqueeze(1) + rows).clamp(max=q.shape[0] - 1)
        q_pad = q[src.long()]  # [S, max_q, H, D]
    if bool((q_lens == seq_lens).all()):
        # Whole prompts (nothing cached before them): query i sits at position i, so plain causal attention is
        # exact (padding lies past every real row and key) and SDPA skips the blocks above the diagonal:
        # ~10% less time than the mask on a 500-token prompt (tests/bench/bench_prefill.py).
        out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, is_causal=True, scale=scale,
                                             enable_gqa=True).transpose(1, 2)
        return out[0] if num_seqs == 1 else out[is_real]
    # Query i of s sits at position seq_len - q_len + i; it sees keys at positions <= it.
    # Padded rows (i >= q_len) see every real key, so no row is fully masked (no NaN).
    q_pos = (seq_lens - q_lens).unsqueeze(1) + rows  # [S, max_q]
    k_pos = torch.arange(k.shape[2], device=q.device)
    mask = (k_pos <= q_pos.unsqueeze(2)) & (k_pos < seq_lens[:, None, None])  # [S, max_q, L]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True
    ).transpose(1, 2)  # [S, max_q, H, D]
    if num_seqs == 1:
        return out[0]
    return out[is_real]


def store_kv_torch(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, bs, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, bs, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    if flat_k.dtype == kv_quant.INT8:
        k, v = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
