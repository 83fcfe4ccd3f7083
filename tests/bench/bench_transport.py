"""KV transport benchmark: 64 MiB of KV blocks between two processes, against memcpy of the same bytes.

    .venv/bin/python tests/bench/bench_transport.py

The cache has the default model's layout (30 layers, 3 KV heads, head_dim 64, fp32, block 16).
Per backend (tcp, and nixl when nixl-cu12 is installed). "Contiguous" sends 89 consecutive blocks
(one run per layer slab); "scattered" sends them to
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
from workers.kv_transport import make_transport  # noqa: E402
from workers.nixl_transport import nixl_available  # noqa: E402

SHAPE = (30, 2, 96, 16, 3, 64)  # 96 blocks of 737,280 bytes (all slabs)
NUM_BLOCKS = 89  # 89 x 737,280 bytes = 62.6 MiB ~ 64 MiB
REPEATS = 7
TARGETS = {"tcp": ">= 0.4x", "nixl": ">= 0.7x"}


def receiver(backend: str, conn) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    transport = make_transport(backend)
    transport.register(torch.zeros(SHAPE))
    conn.send(transport.address())
    conn.recv()  # wait until told to stop
    transport.close()


def median_seconds(fn) -> float:  # type: ignore[no-untyped-def]
    return time_fn(fn, torch.device("cpu"), REPEATS)


def bench_backend(backend: str) -> tuple[float, float, int]:
    """(contiguous seconds, scattered seconds, bytes) for one backend, receiver in another process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(backend, child), daemon=True)
    proc.start()
    peer = parent.recv()
    sender = make_transport(backend)
    cache = torch.randn(SHAPE)
    sender.register(cache)
    num_bytes = NUM_BLOCKS * cache[:, :, 0].numel() * 4
    src = list(range(NUM_BLOCKS))
    scattered = random.Random(0).sample(range(SHAPE[2]), NUM_BLOCKS)
    t_contig = median_seconds(lambda: sender.write_blocks(peer, src, src, "bench", timeout_s=60))
    t_scatter = median_seconds(lambda: sender.write_blocks(peer, src, scattered, "bench", timeout_s=60))
    parent.send("stop")
    proc.join(timeout=10)
    sender.close()
    return t_contig, t_scatter, num_bytes


def main() -> None:
    backends = ["tcp"] + (["nixl"] if nixl_available() else [])
    results = {b: bench_backend(b) for b in backends}
    num_bytes = results["tcp"][2]
    a, b = torch.randn(num_bytes // 4), torch.empty(num_bytes // 4)
    t_memcpy = median_seconds(lambda: b.copy_(a))
    gbs = lambda t: num_bytes / t / 1e9  # noqa: E731
    print(f"payload {num_bytes / 2**20:.1f} MiB, medians of {REPEATS}")
    print("| path | time | GB/s | vs memcpy | target |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| memcpy (one process) | {t_memcpy * 1e3:.1f} ms | {gbs(t_memcpy):.2f} | 1.00x | |")
    for backend, (t_contig, t_scatter, _) in results.items():
        for name, t, target in ((f"{backend}, contiguous runs", t_contig, TARGETS[backend]),
                                (f"{backend}, scattered blocks", t_scatter, "")):
            print(f"| {name} | {t * 1e3:.1f} ms | {gbs(t):.2f} | {t_memcpy / t:.2f}x | {target} |")


if __name__ == "__main__":
    main()
