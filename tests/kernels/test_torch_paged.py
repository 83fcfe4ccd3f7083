"""The vectorized torch path against the readable per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from kernels.host_math import cdiv
from kernels.length_groups import length_groups
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref
from kernels.torch_decode import paged_decode_attention_torch
from kernels.torch_paged import paged_prefill_attention_torch, store_kv_torch


def make_cache(num_blocks=600, bs=16, kvh=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, bs, kvh, d, generator=g), torch.randn(num_blocks, bs, kvh, d, generator=g)


def tables(seq_lens, bs, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(cdiv(n, bs) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=g)[: width * len(seq_lens)]
    return perm.view(len(seq_lens), width).int()  # shuffled, non-contiguous


@pytest.mark.parametrize("seq_lens", [[1, 16, 17, 33], [700, 20, 5, 64, 1500], [40] * 6])
def test_decode_matches_reference(seq_lens):
    kc, vc = make_cache()
    bt = tables(seq_lens, 16, kc.shape[0])
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 6, 32)
    got = paged_decode_attention_torch(q, kc, vc, bt, sl, scale=0.2)
    assert (got - paged_decode_attention_ref(q, kc, vc, bt, sl, scale=0.2)).abs().max() < 1e-5


@pytest.mark.parametrize("kv_heads", [1, 3, 6])  # MQA, GQA, MHA under 6 query heads
def test_decode_reuses_its_plan_across_layers_and_rebuilds_it_for_new_tables(kv_heads):
    seq_lens = [700, 20, 5, 64, 1500]
    layers = [make_cache(kvh=kv_heads, seed=s) for s in range(3)]
    bt = tables(seq_lens, 16, 600)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    for kc, vc in layers:  # as a step's layers call it: the same table tensors, other caches
        qkv = torch.randn(len(seq_lens), 6 + kv_heads, 32)
        q = qkv[:, :6]  # a strided view, as the model passes it
        got = paged_decode_attention_torch(q, kc, vc, bt, sl, scale=0.2)
        assert (got - paged_decode_attention_ref(q, kc, vc, bt, sl, scale=0.2)).abs().max() < 1e-5
    # The next step: new tensors (longer sequences, other blocks) are never served the old plan.
    bt2, sl2 = tables([n + 1 for n in seq_lens], 16, 600, seed=3), sl + 1
    q = torch.randn(len(seq_lens), 6, 32)
    got = paged_decode_attention_torch(q, *layers[0], bt2, sl2, scale=0.2)
    assert (got - paged_decode_attention_ref(q, *layers[0], bt2, sl2, scale=0.2)).abs().max() < 1e-5


@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 5, 17, 100], [1, 16, 40, 100]), ([32, 7, 300], [1500, 7, 420]),
    ([300], [300]), ([5, 17, 100, 33], [5, 17, 100, 33]),  # whole prompts: SDPA's causal path, no mask
    ([200], [232]), ([40, 3, 100], [60, 3, 120]),  # short cached prefixes: the mask
])
def test_prefill_matches_reference(q_lens, seq_lens):
    kc, vc = make_cache()
    bt = tables(seq_lens, 16, kc.shape[0], seed=1)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, 32)
    got = paged_prefill_attention_torch(q, kc, vc, bt, qsl, sl, scale=0.2)
    assert (got - paged_prefill_attention_ref(q, kc, vc, bt, qsl, sl, scale=0.2)).abs().max() < 1e-5


def test_store_kv_skips_padding_slots():
    kc, vc = make_cache(num_blocks=4, bs=4)
    kc2, vc2 = kc.clone(), vc.clone()
    k, v = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    slots = torch.tensor([3, -1, 8, 15, -1])
    store_kv_torch(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_length_groups_bound_padding():
    lens = [2000, 150, 180, 30, 1, 400, 900]
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert max(lens[i] for i in g) <= 2 * max(min(lens[i] for i in g), 64)
    assert len(length_groups([100] * 10)) == 1
