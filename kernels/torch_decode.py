"""Decode attention on CPU, straight from the paged cache: one query per sequence, so the work is
reading K and V once.

- K: a sequence group's blocks are gathered with one ``index_select`` and scored by one ``bmm``
  (one per KV head past ``BLOCK_DIAGONAL_MAX_KV_HEADS``); each KV head is read once, whatever the
  number of query heads sharing it.
- V is never gathered. The output is a weighted sum of V rows, which is exactly
  ``embedding_bag(mode="sum", per_sample_weights=probs)`` over the cache viewed as rows: fbgemm's
  fused gather-and-accumulate, one pass over V (half the bytes the gather-then-SDPA path moved).

The index tensors depend only on the block tables and lengths, which every layer of a step shares,
so they are built once per step (the ``DecodePlan``) and reused by every layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.host_math import cdiv
from kernels.length_groups import length_groups


@dataclass(frozen=True)
class _Group:
    rows: Tensor | None  # this group's batch rows; None: the whole batch
    block_ids: Tensor  # [b * nb] long: each sequence's blocks, padded to the group's longest
    neg_mask: Tensor  # [b, 1, L] 0 for real keys, -inf past a sequence's length
    v_rows: Tensor  # [b * H * L] long: for bag (sequence, head), the V rows it sums, in key order
    v_offsets: Tensor  # [b * H] long: where each bag starts in v_rows


@dataclass(frozen=True)
class DecodePlan:
    block_tables: Tensor  # the step's tensors the plan was built from (kept: identity is the cache key)
    seq_lens: Tensor
    shape: tuple[int, int, int]  # block_size, KV heads, query heads
    groups: list[_Group]


def build_plan(block_tables: Tensor, seq_lens: Tensor, block_size: int, kv_heads: int, num_heads: int) -> DecodePlan:
    groups = length_groups(seq_lens.tolist())
    whole = len(groups) == 1
    plans = []
    for group in groups:
        rows = None if whole else torch.tensor(group, device=seq_lens.device)
        tables = block_tables if rows is None else block_tables[rows]
        lens = seq_lens if rows is None else seq_lens[rows]
        plans.append(_group_plan(rows, tables, lens, block_size, kv_heads, num_heads))
    return DecodePlan(block_tables, seq_lens, (block_size, kv_heads, num_heads), plans)


def _group_plan(rows: Tensor | None, tables: Tensor, lens: Tensor, block_size: int, kv_heads: int,
                num_heads: int) -> _Group:
    dev = lens.device
    batch = lens.shape[0]
    num_blocks = cdiv(int(lens.max()), block_size)
    length = num_blocks * block_size
    block_ids = tables[:, :num_blocks].long()
    pos = torch.arange(length, device=dev)
    real = pos < lens.unsqueeze(1)  # [b, L]
    slots = (block_ids[:, pos // block_size] * block_size + pos % block_size).masked_fill_(~real, 0)
    # The cache viewed as rows [slot * KVH + kv_head, D]; query head h reads KV head h // (H / KVH).
    heads = torch.arange(num_heads, device=dev) // (num_heads // kv_heads)
    v_rows = (slots.unsqueeze(1) * kv_heads + heads[:, None]).reshape(-1)  # [b, H, L] flattened
    neg_mask = torch.zeros(batch, 1, length, device=dev).masked_fill_(~real[:, None, :], float("-inf"))
    v_offsets = torch.arange(0, batch * num_heads * length, length, device=dev)
    return _Group(rows, block_ids.reshape(-1), neg_mask, v_rows, v_offsets)


class _LastPlan(threading.local):
    plan: DecodePlan | None = None


# Per thread (each engine steps on its own thread): the plan of the step it is in. Callers pass new
# table tensors whenever the tables change, as the model runner does every step.
_last = _LastPlan()


def _plan_for(block_tables: Tensor, seq_lens: Tensor, block_size: int, kv_heads: int, num_heads: int) -> DecodePlan:
    plan = _last.plan
    if (plan is None or plan.block_tables is not block_tables or plan.seq_lens is not seq_lens
            or plan.shape != (block_size, kv_heads, num_heads)):
        plan = _last.plan = build_plan(block_tables, seq_lens, block_size, kv_heads, num_heads)
    return plan


def paged_decode_attention_torch(
    q: Tensor,  # [B, H, D]
    k_cache: Tensor,  # [num_blocks, bs, KVH, D]
    v_cache: Tensor,  # [num_blocks, bs, KVH, D]
    block_tables: Tensor,  # [B, M] int32
    seq_lens: Tensor,  # [B] int32
    *,
    scale: float,
) -> Tensor:
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    plan = _plan_for(block_tables, seq_lens, block_size, kv_heads, num_heads)
    k_blocks = k_cache.view(num_blocks, -1)
    v_rows = v_cache.reshape(-1, head_dim)  # a view: the cache is contiguous
    if len(plan.groups) == 1:
        return _attend(q, k_blocks, v_rows, plan.groups[0], kv_heads, scale)
    out = torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = _attend(q[group.rows], k_blocks, v_rows, group, kv_heads, scale)
    return out


# Up to this many KV heads, one bmm against a block-diagonal query matrix scores all heads at once:
# it does KVH x the needed flops but reads K in its gathered layout in one pass (1.6 ms against 2.5
# for a bmm per head, b32 x 528 tokens, 3 KV heads). Beyond, the wasted flops cost more than that.
BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def _attend(q: Tensor, k_blocks: Tensor, v_rows: Tensor, group: _Group, kv_heads: int, scale: float) -> Tensor:
    batch, num_heads, head_dim = q.shape
    per_kv = num_heads // kv_heads
    k = torch.index_select(k_blocks, 0, group.block_ids).view(batch, -1, kv_heads, head_dim)  # [b, L, KVH, D]
    qg = q.view(batch, kv_heads, per_kv, head_dim)
    if kv_heads <= BLOCK_DIAGONAL_MAX_KV_HEADS:
        q_diag = q.new_zeros(batch, kv_heads, head_dim, kv_heads, per_kv)  # [b, KVH*D, H]: head h sees its KV head
        q_diag.diagonal(dim1=1, dim2=3).copy_(qg.permute(0, 3, 2, 1))
        scores = torch.bmm(k.view(batch, -1, kv_heads * head_dim), q_diag.view(batch, -1, num_heads))
        scores = scores.transpose(1, 2).contiguous()  # [b, H, L]
    else:  # per KV head: [b, H/KVH, D] @ [b, D, L], K read with its row stride (no copy)
        scores = torch.cat([torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) for h in range(kv_heads)], dim=1)
    scores = scores.float().mul_(scale).add_(group.neg_mask)  # -inf past each sequence's length
    probs = torch.softmax(scores, dim=-1).to(v_rows.dtype)
    out = F.embedding_bag(group.v_rows, v_rows, group.v_offsets, mode="sum", per_sample_weights=probs.view(-1))
    return out.view(batch, num_heads, head_dim)
