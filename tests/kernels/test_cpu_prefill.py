"""The compiled prefill attention (``kernels/csrc/paged_prefill_cpu.cpp``) against the float64 reference over the
same cache (dequantized where it is fp16 or int8): whole prompts and prompts after cached tokens, several
sequences packed, every GQA ratio, head size, block size and cache dtype; the dispatcher uses it on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu_kernel, kv_quant, paged_prefill_attention
from kernels.reference import paged_prefill_attention_ref
from tests.kernels.test_triton_kernels import shuffled_tables
from tests.threads import torch_threads

GQA = {1: (4, 4), 3: (9, 3), 8: (8, 1)}  # ratio -> (num_heads, num_kv_heads)
DTYPES = (torch.float32, torch.float16, torch.int8)
CASES = list(itertools.product(GQA, cpu_kernel.HEAD_DIMS, [16, 32], DTYPES))
# (seq_len, q_len): a whole prompt, new tokens after a cached prefix (not a multiple of 8 or 16 either side),
# one token, and a long prompt that spans many items of 16 queries
SEQUENCES = [(40, 40), (77, 5), (1, 1), (300, 283)]


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")


def cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches of ``dtype``, and the float64 values they hold."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 2 for _ in range(2))
    if dtype == torch.int8:
        kc, vc = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
        return kc, vc, kv_quant.dequantize_rows(kc, torch.float64), kv_quant.dequantize_rows(vc, torch.float64)
    kc, vc = k.to(dtype), v.to(dtype)
    return kc, vc, kc.double(), vc.double()


def packed(sequences: list[tuple[int, int]], num_heads: int, head_dim: int, block_size: int, num_blocks: int,
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, block tables, query starts and lengths for sequences of (seq_len, q_len)."""
    seq_lens = [s for s, _ in sequences]
    q_lens = torch.tensor([q for _, q in sequences])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=g) * 2
    qsl = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    return q, shuffled_tables(seq_lens, block_size, num_blocks), qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("gqa, head_dim, block_size, dtype", CASES,
                         ids=[f"gqa{g}-d{d}-bs{b}-{str(t)[6:]}" for g, d, b, t in CASES])
def test_prefill_matches_the_reference(gqa: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = GQA[gqa]
    num_blocks = len(SEQUENCES) * -(-max(s for s, _ in SEQUENCES) // block_size) + 4
    kc, vc, k64, v64 = cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=gqa + head_dim)
    q, tables, qsl, lens = packed(SEQUENCES, num_heads, head_dim, block_size, num_blocks, seed=block_size)
    scale = head_dim**-0.5
    expected = paged_prefill_attention_ref(q.double(), k64, v64, tables, qsl, lens, scale=scale)
    got = cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() < 1e-4  # fp32 sums and exp_u20, outputs of ~1-4


@pytest.mark.parametrize("gqa", [3, 8])
@pytest.mark.parametrize("head_dim", cpu_kernel.HEAD_DIMS)
def test_every_instruction_set_gives_the_same_bits(head_dim: int, gqa: int) -> None:
    """The 512-bit loops take 16 rows a vector where the 256-bit ones take 8, and score 3 groups of rows at once
    where those score one, each lane with the same arithmetic in the same order: the same bits for every cache dtype
    (8 query heads a KV head: groups left over after the threes). (On a CPU with AVX2 alone only the reference check
    bites.)"""
    num_heads, num_kv_heads = GQA[gqa]
    isas = cpu_kernel.instruction_sets()
    for dtype in DTYPES:
        kc, vc, k64, v64 = cache(100, 16, num_kv_heads, head_dim, dtype, seed=head_dim)
        q, tables, qsl, lens = packed([(300, 283), (77, 5), (40, 40)], num_heads, head_dim, 16, 100, seed=9)
        scale = head_dim**-0.5
        outs = {}
        for isa in isas:
            with cpu_kernel.instruction_set(isa):
                outs[isa] = cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=scale)
        expected = paged_prefill_attention_ref(q.double(), k64, v64, tables, qsl, lens, scale=scale)
        assert (outs[isas[0]].double() - expected).abs().max().item() < 1e-4
        for isa, got in outs.items():
            assert torch.equal(got, outs[isas[0]]), (isa, dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_rows(threads: int) -> None:
    """Items are taken from a shared counter, longest first: each is still computed whole, by one thread."""
    kc, vc, k64, v64 = cache(100, 16, 3, 64, torch.int8, seed=1)
    q, tables, qsl, lens = packed([(500, 468), (37, 37), (200, 9)], 9, 64, 16, 100, seed=2)
    with torch_threads(1):
        single = cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=0.125)
    with torch_threads(threads):
        got = cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=0.125)
    assert torch.equal(got, single)
    expected = paged_prefill_attention_ref(q.double(), k64, v64, tables, qsl, lens, scale=0.125)
    assert (got.double() - expected).abs().max().item() < 1e-4  # fp32 sums and exp_u20, outputs of ~1-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_read_in_place_from_qkv_rows(dtype: torch.dtype) -> None:
    """The model passes Q as a view of each token's QKV row (rows H + 2 KVH heads apart), no copy: the same output,
    bit for bit, as from a contiguous copy, with rows packed; a view whose heads are not one run is copied first."""
    kc, vc, _, _ = cache(100, 16, 3, 64, dtype, seed=11)
    q, tables, qsl, lens = packed([(300, 283), (77, 5), (40, 40)], 9, 64, 16, 100, seed=12)
    qkv = torch.cat([q, torch.randn(q.shape[0], 6, 64)], dim=1)
    q_view = qkv[:, :9]
    assert not q_view.is_contiguous()
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            want = torch.ops.tandem_cpu.paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125)
            got = torch.ops.tandem_cpu.paged_prefill_attention(q_view, kc, vc, tables, qsl, lens, 0.125)
        assert got.is_contiguous() and torch.equal(got, want), isa
    heads_apart = qkv.transpose(1, 2).contiguous().transpose(1, 2)[:, :9]  # a head's values 15 floats apart
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tandem_cpu.paged_prefill_attention(heads_apart, kc, vc, tables, qsl, lens, 0.125)
    assert torch.equal(cpu_kernel.paged_prefill_attention(heads_apart, kc, vc, tables, qsl, lens, scale=0.125),
                       cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=0.125))


def test_a_query_sees_no_key_past_its_position() -> None:
    """Keys after a query's position are made huge: any leak of them into the output shows."""
    kc, vc, _, _ = cache(8, 16, 1, 32, torch.float32, seed=3)
    q, tables, qsl, lens = packed([(100, 30)], 2, 32, 16, 8, seed=4)
    clean = cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=32**-0.5)
    for block in tables[0].tolist()[100 // 16 + 1:]:
        kc[block], vc[block] = 1e4, 1e4
    tail = tables[0, 100 // 16]
    kc[tail, 100 % 16:], vc[tail, 100 % 16:] = 1e4, 1e4  # slots of the last block past the sequence's end
    assert torch.equal(cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=32**-0.5), clean)


def test_the_dispatcher_takes_it_on_cpu() -> None:
    kc, vc, _, _ = cache(8, 16, 3, 64, torch.int8, seed=5)
    q, tables, qsl, lens = packed([(50, 20)], 9, 64, 16, 8, seed=6)
    got = paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=0.125, backend="cpu")
    assert torch.equal(got, cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale=0.125))


def test_bad_inputs_are_errors() -> None:
    kc, vc, _, _ = cache(8, 16, 3, 64, torch.float32, seed=7)
    q, tables, qsl, lens = packed([(50, 20)], 9, 64, 16, 8, seed=8)
    with pytest.raises(RuntimeError, match="query starts end at 20, not at q's 19 rows"):
        cpu_kernel.paged_prefill_attention(q[:19], kc, vc, tables, qsl, lens, scale=0.125)
    with pytest.raises(RuntimeError, match="20 queries for 10 tokens"):
        cpu_kernel.paged_prefill_attention(q, kc, vc, tables, qsl, torch.tensor([10], dtype=torch.int32), scale=0.125)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        cpu_kernel.paged_prefill_attention(q, kc, vc, tables[:, :2], qsl, lens, scale=0.125)
    with pytest.raises(RuntimeError, match="must both be fp32, both fp16 or both int8"):
        cpu_kernel.paged_prefill_attention(q, kc, vc.half(), tables, qsl, lens, scale=0.125)
