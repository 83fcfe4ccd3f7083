"""Decode attention alone (kernels/csrc/paged_decode_cpu.cpp), per instruction set, from memory and from cache,
over an fp16 cache (``kv_cache_dtype: float16``) and an int8 one (the default under GGUF weights).

    .venv/bin/python tests/bench/bench_decode_attention.py [--batch 8] [--contexts 151,450] [--repeats 15]

The bundled model's shape (30 layers, 9 query heads on 3 KV heads of 64), a step's 30 calls timed together,
median of --repeats, two rounds (the second kept). Three layouts of each sequence's blocks: sequential and
shuffled in a 30-layer cache (read from memory, as in a step), and one layer's blocks shared by every sequence
(in cache: the kernel's arithmetic alone). The caches lie in huge pages, as a worker's does
(``TANDEM_HUGE_PAGES=0``: 4 KB pages). Printed side by side for every instruction set the kernels run here
(``torch.ops.tandem_cpu.set_isa``: 256-bit loops, 512-bit ones from "avx512_vnni").
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

from kernels import cpu_kernel, kv_quant  # noqa: E402
from kernels.huge_pages import huge_page_copies  # noqa: E402

LAYERS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 30, 16, 3, 64, 9


def step_ms(call: Callable[[int], object], layers: list[int], repeats: int) -> float:
    for layer in layers:
        call(layer)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in layers:
            call(layer)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="151,450")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_kernel.available():
        sys.exit(f"the CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    contexts = [int(c) for c in args.contexts.split(",")]
    batch = args.batch
    blocks = max(batch * -(-max(contexts) // BLOCK), 64)
    values = torch.randn(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = dict(zip(("fp16", "int8"), huge_page_copies([values.half(), kv_quant.quantize_rows(values)]), strict=True))
    del values
    q = torch.randn(batch, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    isas = cpu_kernel.instruction_sets()
    print(f"batch {batch}, {LAYERS} layers, {torch.get_num_threads()} threads; ms a step")
    print(f"{'ctx':>5} {'blocks':<11} {'cache':<5} " + " ".join(f"{isa:>12}" for isa in isas))
    for ctx in contexts:
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        n = -(-ctx // BLOCK)
        layouts = {
            "sequential": (torch.arange(batch * n, dtype=torch.int32).reshape(batch, n), list(range(LAYERS))),
            "shuffled": (torch.randperm(blocks, generator=gen)[:batch * n].to(torch.int32).reshape(batch, n),
                         list(range(LAYERS))),
            "in cache": (torch.arange(n, dtype=torch.int32).repeat(batch, 1), [0] * LAYERS),
        }
        for name, (tables, layers) in layouts.items():
            for kind, cache in caches.items():
                def call(layer: int, tables: torch.Tensor = tables, lens: torch.Tensor = lens,
                         cache: torch.Tensor = cache) -> object:
                    return cpu_kernel.paged_decode_attention(q, cache[layer, 0], cache[layer, 1], tables, lens,
                                                             scale=HEAD_DIM**-0.5)
                ms: dict[str, float] = {}
                for _ in range(2):  # the second round is kept
                    for isa in isas:
                        with cpu_kernel.instruction_set(isa):
                            ms[isa] = step_ms(call, layers, args.repeats)
                print(f"{ctx:>5} {name:<11} {kind:<5} " + " ".join(f"{ms[isa]:12.2f}" for isa in isas), flush=True)


if __name__ == "__main__":
    main()
