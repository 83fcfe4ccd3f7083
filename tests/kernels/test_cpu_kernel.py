"""The compiled CPU decode kernel (kernels/csrc/paged_decode_cpu.cpp) against the readable torch
reference: GQA ratios 1, 3 and 8, every head size it takes, block sizes 16 and 32, shuffled block
tables, lengths of 1, block multiples and one past them, and a long one; then through the engine,
where it is the default on CPU."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_kernel, kv_quant, paged_decode_attention, resolve_backend
from kernels.host_math import cdiv
from kernels.reference import paged_decode_attention_ref
from tests.kernels.test_triton_kernels import make_cache, shuffled_tables
from tests.threads import torch_threads

GQA = {1: (4, 4), 3: (9, 3), 8: (8, 1)}  # ratio -> (num_heads, num_kv_heads)
CASES = list(itertools.product(GQA, cpu_kernel.HEAD_DIMS, [16, 32]))


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():  # no compiler or no AVX2: the torch path serves, as dispatch shows
        pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")


@pytest.mark.parametrize("gqa, head_dim, block_size", CASES, ids=[f"gqa{g}-d{d}-bs{b}" for g, d, b in CASES])
def test_decode_matches_reference(gqa: int, head_dim: int, block_size: int) -> None:
    num_heads, num_kv_heads = GQA[gqa]
    seq_lens = [1, block_size, block_size + 1, 3 * block_size, 77, 1000]
    num_blocks = len(seq_lens) * cdiv(max(seq_lens), block_size) + 8  # each row padded to the longest
    kc, vc = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    tables = shuffled_tables(seq_lens, block_size, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, head_dim) * 3  # peaked softmaxes too
    expected = paged_decode_attention_ref(q, kc, vc, tables, lens, scale=head_dim**-0.5)
    for isa in cpu_kernel.instruction_sets():  # 256-bit loops, and 512-bit ones where the CPU has them
        with cpu_kernel.instruction_set(isa):
            got = cpu_kernel.paged_decode_attention(q, kc, vc, tables, lens, scale=head_dim**-0.5)
        assert (got - expected).abs().max().item() < 1e-4, isa


@pytest.mark.parametrize("seq_lens", [[1000], [300], [37, 1000], [129]])
@pytest.mark.parametrize("gqa", [1, 3])
def test_a_small_batch_splits_its_tokens_across_threads(seq_lens: list[int], gqa: int) -> None:
    """Batch 1-2 has fewer (sequence, KV head) items than 2 threads share evenly: each sequence is cut into token
    ranges attended apart and merged by their softmax maxima and sums. Ranges past a shorter sequence's end are
    empty; one thread takes the unsplit path."""
    num_heads, num_kv_heads = GQA[gqa]
    num_blocks = len(seq_lens) * cdiv(max(seq_lens), 16) + 4
    kc, vc = make_cache(num_blocks, 16, num_kv_heads, 64, torch.float32)
    tables = shuffled_tables(seq_lens, 16, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_heads, 64) * 3
    expected = paged_decode_attention_ref(q, kc, vc, tables, lens, scale=0.125)
    for n in (1, 2, 4):
        for isa in cpu_kernel.instruction_sets():
            with torch_threads(n), cpu_kernel.instruction_set(isa):
                got = cpu_kernel.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125)
            assert (got - expected).abs().max().item() < 1e-4, (n, isa)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_threads_take_the_longest_sequences_first_with_the_same_bits(cache_dtype: torch.dtype) -> None:
    """A batch whose long sequences sit together (old chats first) is shared out longest first, a sequence at a
    time: each sequence's output is computed whole by one thread, so 1, 2 and 3 threads give the same bits."""
    seq_lens = [700, 650, 600, 33, 40, 17, 90, 1, 16, 64]
    num_blocks = len(seq_lens) * cdiv(max(seq_lens), 16) + 4
    kc, vc = make_cache(num_blocks, 16, 3, 64, torch.float32)
    tolerance = 1e-4
    if cache_dtype == torch.int8:  # the reference attends over the dequantized rows
        kc, vc = kv_quant.quantize_rows(kc), kv_quant.quantize_rows(vc)
        tolerance = 1e-3  # what the integer scores' int16 queries may move an output
    tables = shuffled_tables(seq_lens, 16, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 9, 64)
    widened = [kv_quant.dequantize_rows(c) if cache_dtype == torch.int8 else c for c in (kc, vc)]
    expected = paged_decode_attention_ref(q, *widened, tables, lens, scale=0.125)
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            outs = []
            for n in (1, 2, 3):
                with torch_threads(n):
                    outs.append(cpu_kernel.paged_decode_attention(q, kc, vc, tables, lens, scale=0.125))
        assert all(torch.equal(out, outs[0]) for out in outs), isa
        assert (outs[0] - expected).abs().max().item() < tolerance, isa


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_queries_read_in_place_from_fused_qkv_rows(cache_dtype: torch.dtype) -> None:
    """The compiled layer stack passes Q as a view of each token's QKV row (rows H + 2 KVH heads apart): the same
    output, bit for bit, as from a contiguous copy; a view whose heads are not one run is refused."""
    num_heads, num_kv_heads, seq_lens = 9, 3, [5, 40, 170]
    num_blocks = len(seq_lens) * cdiv(max(seq_lens), 16) + 4
    kc, vc = make_cache(num_blocks, 16, num_kv_heads, 64, torch.float32)
    if cache_dtype == torch.int8:
        kc, vc = kv_quant.quantize_rows(kc), kv_quant.quantize_rows(vc)
    tables = shuffled_tables(seq_lens, 16, num_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, 64) * 3
    q_view = qkv[:, :num_heads]
    assert not q_view.is_contiguous()
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            want = torch.ops.tandem_cpu.paged_decode_attention(q_view.contiguous(), kc, vc, tables, lens, 0.125)
            got = torch.ops.tandem_cpu.paged_decode_attention(q_view, kc, vc, tables, lens, 0.125)
        assert torch.equal(got, want), isa
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tandem_cpu.paged_decode_attention(qkv.transpose(1, 2)[:, :, :num_heads], kc, vc, tables, lens, 0.1)


def test_default_cpu_backend_and_fallbacks() -> None:
    assert resolve_backend(torch.device("cpu"), None) == "cpu"
    kc, vc = make_cache(8, 16, 2, 64, torch.float16)
    tables, lens = shuffled_tables([20], 16, 8), torch.tensor([20], dtype=torch.int32)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    assert not cpu_kernel.supports(q, kc)  # fp16 stays on the torch path, with the same answer
    got = paged_decode_attention(q, kc, vc, tables, lens, scale=0.125, backend="cpu")
    expected = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, scale=0.125)
    assert (got.float() - expected).abs().max().item() < 1e-2


def test_a_length_past_the_block_table_is_an_error_not_a_crash() -> None:
    kc, vc = make_cache(8, 16, 1, 64, torch.float32)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernel.paged_decode_attention(torch.randn(1, 1, 64), kc, vc, tables, torch.tensor([33], dtype=torch.int32),
                                          scale=1.0)


def test_engine_greedy_output_with_the_cpu_kernel_equals_torch(default_model_and_tokenizer) -> None:
    from tests.tiny_model import tiny_model
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.protocol.sampling_params import SamplingParams

    model = tiny_model(seed=5, num_heads=6, num_kv_heads=2, head_dim=32)
    prompts = [[1, 5, 9, 200, 3000], list(range(100, 141)), [7] * 17]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        engine = Engine(EngineConfig(num_kv_blocks=64, attention_backend=backend, prefill_chunk_size=16),
                        model=model, tokenizer=default_model_and_tokenizer[1])
        assert engine.runner.attention_backend == backend
        outs[backend] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    from kernels.reference import store_kv_ref

    kc, vc = make_cache(4, 4, 2, 32, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv = torch.randn(5, (4 + 2 * 2) * 32).to(dtype)  # K and V as strided views of a fused QKV row
    k = qkv[:, 4 * 32 : 6 * 32].view(5, 2, 32)
    v = qkv[:, 6 * 32 :].view(5, 2, 32)
    slots = torch.tensor([3, -1, 8, 15, -1])
    cpu_kernel.store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_kernel.store_kv(k, v, kc, vc, torch.tensor([0, 1, 2, 3, 16]))
    before = kc.clone(), vc.clone()
    with pytest.raises(RuntimeError, match="one slot a token"):  # fewer slots than rows: not read past the end
        cpu_kernel.store_kv(k, v, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_store_kv_of_a_prompt_is_the_same_on_any_thread_count(dtype: torch.dtype) -> None:
    """A prompt's rows are shared among the threads (past 64 tokens): each row lands as the reference puts it (int8:
    quantized as kv_quant's reference does), whatever the thread count; a bad slot anywhere writes nothing."""
    from kernels.reference import store_kv_ref

    tokens, blocks = 300, 24
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (9 + 2 * 3) * 64, generator=g)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(tokens, 3, 64), qkv[:, 12 * 64 :].view(tokens, 3, 64)
    slots = torch.randperm(blocks * 16, generator=g)[:tokens]
    slots[::7] = -1  # padding rows, skipped
    width = 64 + 4 if dtype == torch.int8 else 64
    empty = torch.zeros(blocks, 16, 3, width, dtype=dtype)
    if dtype == torch.int8:
        want = [torch.zeros(blocks * 16, 3, 64) for _ in range(2)]
        for cache, rows in zip(want, (k, v), strict=True):
            cache[slots[slots >= 0]] = rows[slots >= 0]
        want_k, want_v = (kv_quant.quantize_rows(c.view(blocks, 16, 3, 64)) for c in want)  # empty rows: zeros
    else:
        want_k, want_v = empty.clone(), empty.clone()
        store_kv_ref(k.to(dtype), v.to(dtype), want_k, want_v, slots)
    for threads in (1, 2, 3):
        kc, vc = empty.clone(), empty.clone()
        with torch_threads(threads):
            cpu_kernel.store_kv(k, v, kc, vc, slots)  # fp32 rows, into a cache of dtype
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), threads
        bad = slots.clone()
        bad[-1] = blocks * 16
        kc, vc = empty.clone(), empty.clone()
        with torch_threads(threads), pytest.raises(RuntimeError, match="past the cache"):
            cpu_kernel.store_kv(k, v, kc, vc, bad)
        assert torch.equal(kc, empty) and torch.equal(vc, empty), threads


def test_an_fp16_cache_reads_as_its_exact_fp32_widening() -> None:
    """Half the bytes a step reads, the same arithmetic: F16C widens each value exactly, so attention over an
    fp16 cache equals attention over that cache converted to fp32, bit for bit."""
    seq_lens = [1, 16, 17, 77, 300]
    kc, vc = make_cache(len(seq_lens) * 19 + 4, 16, 3, 64, torch.float32)
    kc16, vc16 = kc.half(), vc.half()
    tables = shuffled_tables(seq_lens, 16, kc.shape[0])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), 9, 64) * 3
    exact = paged_decode_attention_ref(q, kc, vc, tables, lens, scale=0.125)
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            got = cpu_kernel.paged_decode_attention(q, kc16, vc16, tables, lens, scale=0.125)
            widened = cpu_kernel.paged_decode_attention(q, kc16.float(), vc16.float(), tables, lens, scale=0.125)
        assert torch.equal(got, widened), isa
        assert (got - exact).abs().max().item() < 1e-2, isa  # what rounding K and V to fp16 costs
    with pytest.raises(RuntimeError, match="must both be fp32, both fp16 or both int8"):
        cpu_kernel.paged_decode_attention(q, kc16, vc, tables, lens, scale=0.125)


def test_store_kv_rounds_fp32_rows_into_an_fp16_cache_as_torch_does() -> None:
    kc, vc = make_cache(4, 4, 2, 36, torch.float16)  # 72 values a row: the 8-wide loop and its tail
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv = torch.randn(5, (4 + 2 * 2) * 36) * 1000  # past fp16's precision, some rounding each way
    k, v = qkv[:, 4 * 36 : 6 * 36].view(5, 2, 36), qkv[:, 6 * 36 :].view(5, 2, 36)
    slots = torch.tensor([3, -1, 8, 15, 0])
    cpu_kernel.store_kv(k, v, kc, vc, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            kc_ref.view(-1, 2, 36)[slot] = k[t].half()
            vc_ref.view(-1, 2, 36)[slot] = v[t].half()
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    with pytest.raises(RuntimeError, match="cannot go into a cache"):
        cpu_kernel.store_kv(k.half(), v.half(), kc.float(), vc.float(), slots)


def _isa_in_fresh_process(pinned: str) -> subprocess.CompletedProcess[str]:
    code = ("from kernels import cpu_kernel; import torch; cpu_kernel.available(); "
            "print(torch.ops.tandem_cpu.isa())")
    env = {**os.environ, "TANDEM_CPU_ISA": pinned}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])


def test_tandem_cpu_isa_pins_the_instruction_set_a_process_starts_on() -> None:
    oldest, best = cpu_kernel.instruction_sets()[0], cpu_kernel.instruction_sets()[-1]
    assert oldest == "avx2"
    pinned = _isa_in_fresh_process("avx2")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == ["avx2"]
    assert _isa_in_fresh_process("best").stdout.split() == [best]
    unknown = _isa_in_fresh_process("sse9")
    assert unknown.returncode != 0 and "TANDEM_CPU_ISA=sse9: unknown instruction set" in unknown.stderr
    if best != "amx":  # a set this CPU lacks is refused by name too
        lacking = _isa_in_fresh_process("amx")
        assert lacking.returncode != 0 and "TANDEM_CPU_ISA=amx: this CPU" in lacking.stderr
