"""Readable torch references for the paged-attention contract: one sequence at a time.

Slow on purpose; tests compare every other backend against these.

Paged layout (block_size 4): sequence s with 6 tokens and block table [7, 2]:

    k_cache[7] = tokens 0..3 of s      k_cache[2] = tokens 4..5 of s (+2 free slots)
    slot of token t = block_tables[s, t // 4] * 4 + t % 4
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.host_math import cdiv


def gather_sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, ``[seq_len, num_kv_heads, head_dim]`` each."""
    block_size = k_cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    ids = block_table[:num_blocks].long()
    k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:seq_len]
    v = v_cache[ids].reshape(-1, *v_cache.shape[2:])[:seq_len]
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the *last* ``len(q)`` positions over ``len(k)`` keys, in fp32.

    q: [q_len, H, D]; k, v: [kv_len, KVH, D] -> [q_len, H, D]
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    # query i sits at position kv_len - q_len + i and sees keys at positions <= it
    pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
    pos_k = torch.arange(kv_len, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


def paged_decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               *, scale: float) -> Tensor:
    out = torch.empty_like(q)
    for s in range(q.shape[0]):
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[s], int(seq_lens[s]))
        out[s] = attend(q[s : s + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                query_start_loc: Tensor, seq_lens: Tensor, *, scale: float) -> Tensor:
    out = torch.empty_like(q)
    for s in range(seq_lens.shape[0]):
        lo, hi = int(query_start_loc[s]), int(query_start_loc[s + 1])
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[s], int(seq_lens[s]))
        out[lo:hi] = attend(q[lo:hi], k, v, scale)
    return out


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]
