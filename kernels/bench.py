"""Benchmark of the Triton attention kernels on a GPU, beside torch SDPA on the same shapes.

    python -m kernels.bench            # on a CUDA machine
    python -m kernels.bench --smoke    # tiny shapes anywhere (CPU: TRITON_INTERPRET=1), checks the script runs

Decode: achieved bandwidth (KV bytes read / time) at batch 1, 16, 64 x context 1K, 4K, 16K, as a
share of the GPU's HBM peak (target >= 70% at batch >= 16 and context >= 4K). SDPA reads the same
KV from contiguous tensors (no paging), so it is an upper bound for a paged kernel.
Prefill: TFLOP/s of causal attention over fresh prompts against SDPA (target: time within 1.3x).
Shapes are Llama-3-8B-like: 32 query heads, 8 KV heads, head_dim 128, bf16, block 16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kernels import paged_decode_attention, paged_prefill_attention
from kernels.host_math import cdiv

HBM_PEAK_BYTES_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def hbm_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_PEAK_BYTES_S.items() if k in name), None)


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int, warmup: bool = True) -> float:
    """Median seconds per call (``warmup``: one untimed call first, on CPU). On a GPU: the kernels' own
    time (see ``gpu_kernel_time``); host-side launch cost is ``host_time``."""
    if device.type == "cuda":
        return gpu_kernel_time(fn)
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_kernel_time(fn: Callable[[], object], rounds: int = 5, calls: int = 10) -> float:
    """Seconds of GPU kernel time per call, from the profiler's device timings: the median over
    ``rounds`` of the mean over ``calls``. Launch gaps don't count, so small shapes are not hidden behind
    host overhead (``triton.testing.do_bench`` times the stream and, below ~80 us, measures the launch)."""
    fn()
    fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        per_round.append(sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e6)
    return statistics.median(per_round)


def host_time(fn: Callable[[], object], device: torch.device, calls: int = 200) -> float:
    """Seconds of host time per call when calls are queued back to back: what launching costs an
    engine that does not replay CUDA graphs."""
    if device.type != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return seconds


def paged_layout(batch: int, ctx: int, kv_heads: int, head_dim: int, block: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = batch * cdiv(ctx, block)
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, -1).to(torch.int32)  # shuffled pages
    return k_cache, v_cache, tables


def contiguous_kv(k_cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, KVH, ctx, D]: the same KV unpaged, for SDPA."""
    b = tables.shape[0]
    return k_cache[tables.long()].view(b, -1, *k_cache.shape[2:])[:, :ctx].transpose(1, 2).contiguous()


def bench_decode(batches: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict[str, float]]:
    rows = []
    peak = hbm_peak(device)
    for batch in batches:
        for ctx in contexts:
            k_cache, v_cache, tables = paged_layout(batch, ctx, kv_heads, head_dim, 16, dtype, device)
            seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
            q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
            scale = head_dim**-0.5
            triton_fn = partial(paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, scale=scale,
                                backend="triton")
            t_triton = time_fn(triton_fn, device, repeats)
            k, v = contiguous_kv(k_cache, tables, ctx), contiguous_kv(v_cache, tables, ctx)
            t_sdpa = time_fn(partial(F.scaled_dot_product_attention, q.unsqueeze(2), k, v, scale=scale,
                                     enable_gqa=True), device, repeats)
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
            rows.append({"batch": batch, "ctx": ctx, "triton_us": t_triton * 1e6, "sdpa_us": t_sdpa * 1e6,
                         "triton_GBs": kv_bytes / t_triton / 1e9, "sdpa_GBs": kv_bytes / t_sdpa / 1e9,
                         "triton_host_us": host_time(triton_fn, device) * 1e6,
                         "triton_peak_pct": 100 * kv_bytes / t_triton / peak if peak else float("nan")})
    return rows


def bench_prefill(lengths: list[int], total_tokens: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict[str, float]]:
    rows = []
    for length in lengths:
        batch = max(1, total_tokens // length)
        k_cache, v_cache, tables = paged_layout(batch, length, kv_heads, head_dim, 16, dtype, device)
        q = torch.randn(batch * length, heads, head_dim, device=device, dtype=dtype)
        qsl = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * length
        seq_lens = torch.full((batch,), length, device=device, dtype=torch.int32)
        scale = head_dim**-0.5
        triton_fn = partial(paged_prefill_attention, q, k_cache, v_cache, tables, qsl, seq_lens, scale=scale,
                            backend="triton", max_query_len=length)
        t_triton = time_fn(triton_fn, device, repeats)
        qd = q.view(batch, length, heads, head_dim).transpose(1, 2)
        k, v = contiguous_kv(k_cache, tables, length), contiguous_kv(v_cache, tables, length)
        t_sdpa = time_fn(partial(F.scaled_dot_product_attention, qd, k, v, scale=scale, is_causal=True,
                                 enable_gqa=True), device, repeats)
        flops = 4 * batch * heads * head_dim * length * length / 2  # causal: half the square
        rows.append({"len": length, "batch": batch, "triton_TFLOPs": flops / t_triton / 1e12,
                     "sdpa_TFLOPs": flops / t_sdpa / 1e12, "time_ratio_vs_sdpa": t_triton / t_sdpa,
                     "triton_host_us": host_time(triton_fn, device) * 1e6})
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: check the script, not the GPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        decode = bench_decode([1, 2], [64], 4, 2, 64, dtype, device, repeats=2)
        prefill = bench_prefill([32], 64, 4, 2, 64, dtype, device, repeats=2)
    else:
        if device.type != "cuda":
            raise SystemExit("kernels.bench needs a CUDA GPU (use --smoke to check the script elsewhere)")
        decode = bench_decode([1, 16, 64], [1024, 4096, 16384], 32, 8, 128, torch.bfloat16, device, repeats=20)
        prefill = bench_prefill([512, 1024, 4096], 16384, 32, 8, 128, torch.bfloat16, device, repeats=20)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}, HBM peak {hbm_peak(device) or 'unknown'} B/s")
    print("GPU times are the kernels' own (profiler); host us is what launching one call costs the host.")
    print("| batch | ctx | triton us | SDPA us | triton GB/s | SDPA GB/s | triton % of HBM peak | triton host us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in decode:
        print(f"| {r['batch']} | {r['ctx']} | {r['triton_us']:.1f} | {r['sdpa_us']:.1f} | {r['triton_GBs']:.0f} | "
              f"{r['sdpa_GBs']:.0f} | {r['triton_peak_pct']:.0f} | {r['triton_host_us']:.0f} |")
    print("| prefill len | batch | triton TFLOP/s | SDPA TFLOP/s | time vs SDPA | triton host us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in prefill:
        print(f"| {r['len']} | {r['batch']} | {r['triton_TFLOPs']:.2f} | {r['sdpa_TFLOPs']:.2f} | "
              f"{r['time_ratio_vs_sdpa']:.2f}x | {r['triton_host_us']:.0f} |")
    return {"decode": decode, "prefill": prefill}


if __name__ == "__main__":
    main()
