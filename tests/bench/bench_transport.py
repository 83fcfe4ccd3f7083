"""KV transport benchmark: 64 MiB of KV blocks between two processes, against memcpy of the same bytes.

    .venv/bin/python tests/bench/bench_transport.py

The cache has the default model's layout (30 layers, 3 KV heads, head_dim 64, fp32, block 16).
"Contiguous" sends 89 consecutive blocks (one run per layer slab); "scattered" sends them to
shuffled destinations (one run per block), the worst case for coalescing.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.bench import time_fn  # noqa: E402
from workers.tcp_transport import TcpTransport  # noqa: E402

SHAPE = (30, 2, 96, 16, 3, 64)  # 96 blocks of 737,280 bytes (all slabs)
NUM_BLOCKS = 89  # 89 x 737,280 bytes = 62.6 MiB ~ 64 MiB
REPEATS = 7


def receiver(conn) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    transport = TcpTransport()
    transport.register(torch.zeros(SHAPE))
    conn.send(transport.address())
    conn.recv()  # wait until told to stop
    transport.close()


def median_seconds(fn) -> float:  # type: ignore[no-untyped-def]
    return time_fn(fn, torch.device("cpu"), REPEATS)


def main() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,), daemon=True)
    proc.start()
    peer = parent.recv()
    sender = TcpTransport()
    sender.register(torch.randn(SHAPE))
    num_bytes = NUM_BLOCKS * sender.kv_cache[:, :, 0].numel() * 4
    src = list(range(NUM_BLOCKS))
    scattered = random.Random(0).sample(range(SHAPE[2]), NUM_BLOCKS)
    t_contig = median_seconds(lambda: sender.write_blocks(peer, src, src, "bench", timeout_s=60))
    t_scatter = median_seconds(lambda: sender.write_blocks(peer, src, scattered, "bench", timeout_s=60))
    a, b = torch.randn(num_bytes // 4), torch.empty(num_bytes // 4)
    t_memcpy = median_seconds(lambda: b.copy_(a))
    parent.send("stop")
    proc.join(timeout=10)
    sender.close()
    gbs = lambda t: num_bytes / t / 1e9  # noqa: E731
    print(f"payload {num_bytes / 2**20:.1f} MiB, medians of {REPEATS}")
    print("| path | time | GB/s | vs memcpy | target |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| memcpy (one process) | {t_memcpy * 1e3:.1f} ms | {gbs(t_memcpy):.2f} | 1.00x | |")
    for name, t, target in (("tcp, contiguous runs", t_contig, ">= 0.4x"), ("tcp, scattered blocks", t_scatter, "")):
        print(f"| {name} | {t * 1e3:.1f} ms | {gbs(t):.2f} | {t_memcpy / t:.2f}x | {target} |")


if __name__ == "__main__":
    main()
