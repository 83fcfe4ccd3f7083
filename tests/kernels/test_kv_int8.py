"""The int8 KV cache (``kernels/kv_quant.py``, ``kv_cache_dtype: int8``): each head row's D values quantized
with its own scale, stored after them. The compiled store writes the torch reference's bits; the compiled
decode attention over an int8 cache equals the reference attention over that cache dequantized (every
instruction set, GQA ratio, head size and block size, split and unsplit); the prefill path reads it the
same way; a cache the kernels cannot read is an error, not a wrong answer."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu_kernel, kv_quant, paged_decode_attention, store_kv
from kernels.host_math import cdiv
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from kernels.torch_paged import paged_prefill_attention_torch, store_kv_torch
from tests.kernels.test_triton_kernels import shuffled_tables
from tests.threads import torch_threads

GQA = {1: (4, 4), 3: (9, 3), 8: (8, 1)}  # ratio -> (num_heads, num_kv_heads)
CASES = list(itertools.product(GQA, cpu_kernel.HEAD_DIMS, [16, 32]))
QUERY_ROUNDING = 1e-3  # the most the integer scores' int16 queries may move an output (of ~1) here


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")


def int8_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (kv_quant.quantize_rows(torch.randn(*shape, generator=g) * 2),
            kv_quant.quantize_rows(torch.randn(*shape, generator=g)))


def test_rows_hold_values_then_their_scale() -> None:
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0, 0.25, -0.125, 2.0, 1.5], [0.0] * 8])
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 8 + kv_quant.SCALE_BYTES)
    assert rows[0, :8].tolist() == [32, -127, 64, 0, 16, -8, 127, 95]  # 0.5 / (2 / 127) = 31.75 -> 32; 95.25 -> 95
    assert rows[0, 8:].view(torch.float32).item() == pytest.approx(2.0 / 127)
    assert rows[1].tolist() == [0] * 12  # a row of zeros: zeros, scale 0
    back = kv_quant.dequantize_rows(rows)
    assert back.shape == x.shape and (back - x).abs().max() <= 1 / 127  # at most half a step (2 / 127 / 2)
    assert kv_quant.head_dim_of(rows) == 8 and kv_quant.head_row(torch.int8, 64) == 68


def test_store_writes_the_reference_bits_and_skips_padding() -> None:
    kc = torch.zeros(4, 4, 2, 32 + kv_quant.SCALE_BYTES, dtype=torch.int8)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv = torch.randn(5, (4 + 2 * 2) * 32) * 5  # K and V as strided views of a fused QKV row
    qkv[2, 4 * 32 : 5 * 32] = 0  # one K head of zeros
    k, v = qkv[:, 4 * 32 : 6 * 32].view(5, 2, 32), qkv[:, 6 * 32 :].view(5, 2, 32)
    slots = torch.tensor([3, -1, 8, 15, -1])
    cpu_kernel.store_kv(k, v, kc, vc, slots)
    store_kv_torch(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert kc.view(-1, 2, 36)[8, 0].abs().sum() == 0
    assert kc.view(-1, 2, 36)[[0, 1, 2, 4]].abs().sum() == 0  # only the real tokens' slots written
    no_scales = torch.zeros(4, 4, 2, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        cpu_kernel.store_kv(k, v, no_scales, no_scales.clone(), slots)


@pytest.mark.parametrize("gqa, head_dim, block_size", CASES, ids=[f"gqa{g}-d{d}-bs{b}" for g, d, b in CASES])
def test_decode_equals_attention_over_the_dequantized_cache(gqa: int, head_dim: int, block_size: int) -> None:
    num_heads, num_kv_heads = GQA[gqa]
    seq_lens = [1, block_size, block_size + 1, 3 * block_size, 77, 1000]
    num_blocks = len(seq_lens) * cdiv(max(seq_lens), block_size) + 8
    kc, vc = int8_cache(num_blocks, block_size, num_kv_heads, head_dim)
    tables = shuffled_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim) * 3
    scale = head_dim**-0.5
    expected = paged_decode_attention_ref(q.double(), kv_quant.dequantize_rows(kc, torch.float64),
                                          kv_quant.dequantize_rows(vc, torch.float64), tables, lens, scale=scale)
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            got = cpu_kernel.paged_decode_attention(q, kc, vc, tables, lens, scale=scale)
        # The integer scores (head sizes of a multiple of 32) round each query head to 15 bits (vpdpwssd on 512-bit
        # loops, vpmaddwd on 256-bit ones): up to ~5e-4 here (head size 256, queries x3), against ~1e-7 without;
        # quantizing K and V itself costs ~1e-2 (the test below)
        assert (got.double() - expected).abs().max().item() < QUERY_ROUNDING, isa


@pytest.mark.parametrize("seq_lens", [[1000], [37, 1000]])
def test_split_sequences_read_the_scales_of_their_own_ranges(seq_lens: list[int]) -> None:
    kc, vc = int8_cache(len(seq_lens) * cdiv(max(seq_lens), 16) + 4, 16, 3, 64)
    tables = shuffled_tables(seq_lens, 16, kc.shape[0])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 9, 64) * 3
    expected = paged_decode_attention_ref(q.double(), kv_quant.dequantize_rows(kc, torch.float64),
                                          kv_quant.dequantize_rows(vc, torch.float64), tables, lens, scale=0.125)
    for n in (1, 2, 4):
        with torch_threads(n):
            got = cpu_kernel.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
        assert (got.double() - expected).abs().max().item() < QUERY_ROUNDING, n


def test_an_int8_cache_stays_close_to_the_exact_one() -> None:
    """What quantizing K and V costs the attention output: a few thousandths, against an fp32 cache's."""
    seq_lens = [16, 77, 300]
    g = torch.Generator().manual_seed(3)
    kf, vf = torch.randn(80, 16, 3, 64, generator=g), torch.randn(80, 16, 3, 64, generator=g)
    tables = shuffled_tables(seq_lens, 16, 80)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(3, 9, 64, generator=g) * 3
    exact = paged_decode_attention_ref(q, kf, vf, tables, lens, scale=0.125)
    got = cpu_kernel.paged_decode_attention(q, kv_quant.quantize_rows(kf), kv_quant.quantize_rows(vf), tables, lens,
                                            scale=0.125)
    err = (got - exact).abs().max().item()
    assert 1e-5 < err < 0.05, err  # above zero: the cache really is int8


def test_prefill_reads_the_int8_cache_dequantized() -> None:
    seq_lens, q_lens = [40, 17], [40, 5]  # a whole prompt, and 5 new tokens after a cached 12
    kc, vc = int8_cache(16, 16, 3, 64)
    tables = shuffled_tables(seq_lens, 16, 16)
    q = torch.randn(sum(q_lens), 9, 64)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = paged_prefill_attention_torch(q, kc, vc, tables, qsl, lens, scale=0.125)
    want = paged_prefill_attention_ref(q, kv_quant.dequantize_rows(kc), kv_quant.dequantize_rows(vc), tables, qsl, lens,
                                       scale=0.125)
    assert (got - want).abs().max().item() < 1e-5


def test_only_the_compiled_attention_reads_an_int8_cache() -> None:
    kc, vc = int8_cache(8, 16, 2, 64)
    tables, lens = shuffled_tables([20], 16, 8), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="int8 KV cache is read by the compiled CPU attention only"):
        paged_decode_attention(torch.randn(1, 4, 64), kc, vc, tables, lens, scale=0.125, backend="torch")
    with pytest.raises(RuntimeError, match="head shapes disagree"):  # rows without their scales
        cpu_kernel.paged_decode_attention(torch.randn(1, 4, 68), kc, vc, tables, lens, scale=0.125)
    k = torch.randn(3, 2, 64)
    kc_torch, vc_torch = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(k, k, kc_torch, vc_torch, torch.tensor([0, 5, 9]), backend="torch")  # the torch store quantizes too
    assert torch.equal(kc_torch.view(-1, 2, 68)[[0, 5, 9]], kv_quant.quantize_rows(k))
