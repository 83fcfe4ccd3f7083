"""KV transport benchmark: 64 MiB of KV blocks between two processes, against memcpy of the same bytes.

    .venv/bin/python tests/bench/bench_transport.py [--rounds 9] [--backends tcp,tcp-sockets,nixl,nccl]

The cache has the default model's layout (30 layers, 3 KV heads, head_dim 64, fp32, block 16).
Per backend, each with its receiver in another process: tcp (which copies with process_vm_writev
between processes of one host), tcp-sockets (the same transport with that copy off: the path
between hosts, here over loopback), nixl when nixl-cu12 is installed, and nccl (torch.distributed
send/recv; between these CPU caches it runs over gloo, so its figure here is gloo's, not NCCL's).
"Contiguous" sends 89 consecutive blocks (one run per layer slab); "scattered" sends them to
shuffled destinations (one run per block), the worst case for coalescing.

The machine is shared and noisy, so the measurements are interleaved: each round times a memcpy
(libc ``memcpy`` of the same bytes, one thread, as the target names), torch's ``copy_`` (both
cores, for context) and every transfer, back to back. The ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.transport.base import KVTransport  # noqa: E402
from workers.transport.factory import make_transport  # noqa: E402
from workers.transport.nixl import nixl_available  # noqa: E402
from workers.transport.tcp import TcpTransport  # noqa: E402

SHAPE = (30, 2, 96, 16, 3, 64)  # 96 blocks of 737,280 bytes (all slabs)
NUM_BLOCKS = 89  # 89 x 737,280 bytes = 62.6 MiB ~ 64 MiB
TARGETS = {"tcp": 0.4, "tcp-sockets": 0.4, "nixl": 0.7}
_memcpy = ctypes.CDLL(None).memcpy
_memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def make(backend: str) -> KVTransport:
    return TcpTransport(same_host_copy=False) if backend == "tcp-sockets" else make_transport(backend)


def receiver(backend: str, conn) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    transport = make(backend)
    transport.register(torch.zeros(SHAPE))
    conn.send(transport.address())
    conn.recv()  # wait until told to stop
    transport.close()


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--backends", default="tcp,tcp-sockets,nixl,nccl",
                        help="comma-separated; nixl is left out when nixl-cu12 is not installed")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b != "nixl" or nixl_available()]
    ctx = mp.get_context("spawn")
    cache = torch.randn(SHAPE)
    num_bytes = NUM_BLOCKS * cache[:, :, 0].numel() * cache.element_size()
    src = list(range(NUM_BLOCKS))
    scattered = random.Random(0).sample(range(SHAPE[2]), NUM_BLOCKS)
    a, b = torch.randn(num_bytes // 4), torch.empty(num_bytes // 4)
    paths: dict[str, Callable[[], object]] = {
        "memcpy": lambda: _memcpy(b.data_ptr(), a.data_ptr(), num_bytes),
        "torch copy_": lambda: b.copy_(a),
    }
    ends = []
    for backend in backends:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=receiver, args=(backend, child), daemon=True)
        proc.start()
        peer = parent.recv()
        sender = make(backend)
        sender.register(cache)
        ends.append((parent, proc, sender))
        for name, dst in (("contiguous runs", src), ("scattered blocks", scattered)):
            paths[f"{backend}, {name}"] = (lambda s=sender, p=peer, d=dst:  # type: ignore[misc]
                                           s.write_blocks(p, src, d, "bench", timeout_s=60))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up: connections, page faults
    for _ in range(args.rounds):
        for name, fn in paths.items():
            times[name].append(seconds(fn))
    for parent, proc, sender in ends:
        parent.send("stop")
        proc.join(timeout=10)
        sender.close()

    print(f"payload {num_bytes / 2**20:.1f} MiB, {args.rounds} interleaved rounds, medians")
    print("| path | time | GB/s | vs memcpy | target |")
    print("| --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        t = statistics.median(ts)
        ratio = statistics.median(m / x for m, x in zip(times["memcpy"], ts, strict=True))
        backend = name.split(",")[0]
        target = f">= {TARGETS[backend]}x" if name.endswith("contiguous runs") and backend in TARGETS else ""
        print(f"| {name} | {t * 1e3:.1f} ms | {num_bytes / t / 1e9:.2f} | {ratio:.2f}x | {target} |")


if __name__ == "__main__":
    main()
