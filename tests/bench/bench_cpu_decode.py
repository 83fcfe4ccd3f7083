"""CPU decode attention, per step of the default model's 30 layers: the compiled kernel against the
torch path and against attention's two matmuls over unpaged K/V (what no paged kernel beats).

    .venv/bin/python tests/bench/bench_cpu_decode.py [--rounds 9]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block 16), batch 32, fp32. Every layer
has its own cache, so K/V come from memory as in a real step; block tables are shuffled. The three
paths run interleaved, round after round, and the figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import cpu_kernel  # noqa: E402
from kernels.bench import contiguous_kv, paged_layout  # noqa: E402
from kernels.torch_decode import paged_decode_attention_torch  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(ctx: int, batch: int, rounds: int) -> tuple[float, float, float]:
    """Median seconds per step: compiled kernel, torch path, matmuls over unpaged K/V."""
    cpu, scale = torch.device("cpu"), HEAD_DIM**-0.5
    layers = [paged_layout(batch, ctx, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, cpu) for _ in range(LAYERS)]
    unpaged = [(contiguous_kv(k, t, ctx), contiguous_kv(v, t, ctx)) for k, v, t in layers]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    qg = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)

    def kernel() -> None:
        for k, v, t in layers:
            cpu_kernel.paged_decode_attention(q, k, v, t, seq_lens, scale=scale)

    def torch_path() -> None:
        for k, v, t in layers:
            paged_decode_attention_torch(q, k, v, t, seq_lens, scale=scale)

    def matmuls() -> None:  # q.K^T and p.V per KV head group, K/V already contiguous (no softmax)
        for k, v in unpaged:
            torch.matmul(torch.matmul(qg, k.transpose(-1, -2)), v)

    times: list[list[float]] = [[], [], []]
    for _ in range(rounds + 1):
        for i, fn in enumerate((kernel, torch_path, matmuls)):
            times[i].append(seconds(fn))
    k_s, t_s, m_s = (statistics.median(ts[1:]) for ts in times)  # round 0 warms up
    return k_s, t_s, m_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if not cpu_kernel.available():
        raise SystemExit(f"the CPU kernel is not available here: {cpu_kernel.unavailable_reason()}")
    print(f"decode attention over {LAYERS} layers, batch {args.batch}, {torch.get_num_threads()} torch threads; "
          f"medians of {args.rounds} interleaved rounds")
    print("| context | compiled kernel | torch path | matmuls over unpaged K/V | kernel / torch | kernel / matmuls |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ctx in (64, 256, 512, 2048):
        k_s, t_s, m_s = measure(ctx, args.batch, args.rounds)
        print(f"| {ctx} | {k_s * 1e3:.1f} ms | {t_s * 1e3:.1f} ms | {m_s * 1e3:.1f} ms | {k_s / t_s:.2f}x | "
              f"{k_s / m_s:.2f}x |")


if __name__ == "__main__":
    main()
