"""The default model's decode weights read from 4 KB pages and from 2 MB pages, side by side in one run.

    .venv/bin/python tests/bench/bench_huge_pages.py [--rounds 4] [--steps 40]

A decode step streams every weight once; ``LlamaModel`` moves its GGUF blocks into memory advised for
transparent huge pages (kernels/huge_pages.py). Measured, alternating within each round:
1. the read bandwidth of a ``sum`` over 512 MB (1 and 2 threads; bench_quant_decode's): what the bus gives a
   plain stream now;
2. the bundled model's 120 layer matrices (Q4_1 by 8 rows, 66 MB: twice this CPU's 32 MB L3) multiplied in a
   step's order by one row of x on 1 and 2 threads, the weights in 4 KB pages and then in huge pages (GB/s);
3. engine decode steps at batch 1 and 8 (median), two engines of the default model, one built with
   ``TANDEM_HUGE_PAGES=0``.
Prints the medians and the huge/small ratios. Needs THP "always" or "madvise" to show a difference (printed).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kernels import cpu_kernel  # noqa: E402
from kernels.huge_pages import transparent_huge_pages  # noqa: E402
from kernels.quant_linear import QuantizedWeight, linear  # noqa: E402
from tests.bench.bench_quant_decode import decode_step_seconds, log, read_bandwidth  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402


def engine(huge: bool) -> Engine:
    os.environ["TANDEM_HUGE_PAGES"] = "1" if huge else "0"
    try:
        return Engine(EngineConfig(num_kv_blocks=1024, enable_prefix_caching=False))
    finally:
        del os.environ["TANDEM_HUGE_PAGES"]


def sum_bandwidth(threads: int) -> float:
    torch.set_num_threads(threads)
    return read_bandwidth() / 1e9


def matrix_bandwidth(weights: list[QuantizedWeight], threads: int) -> float:
    torch.set_num_threads(threads)
    xs = {w.in_features: torch.randn(1, w.in_features) for w in weights}
    nbytes = sum(w.data.numel() for w in weights)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in weights:
            linear(xs[w.in_features], w)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if not cpu_kernel.available():
        sys.exit(f"the CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    log(f"transparent huge pages: {transparent_huge_pages()}; loading the default model twice")
    engines = {"huge": engine(True), "small": engine(False)}
    stack = [getattr(layer, name) for layer in engines["huge"].model.layers
             for name in ("qkv", "o_proj", "gate_up", "down")]
    assert all(isinstance(w, QuantizedWeight) for w in stack), "the default model's GGUF weights stay quantized"
    matrices = {"huge": stack, "small": [QuantizedWeight(w.format, w.data.clone(), w.in_features) for w in stack]}
    rng = random.Random(0)
    figures: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for threads in (1, 2):
            figures.setdefault(f"sum t{threads}", []).append(sum_bandwidth(threads))
            for kind in ("small", "huge"):
                figures.setdefault(f"layers t{threads} {kind}", []).append(matrix_bandwidth(matrices[kind], threads))
        for kind in ("small", "huge"):
            for batch in (1, 8):
                torch.set_num_threads(2)
                step_ms = decode_step_seconds(engines[kind], batch, args.steps, rng) * 1e3
                figures.setdefault(f"decode b{batch} {kind}", []).append(step_ms)
        log(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in figures.items()))
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"medians of {args.rounds} rounds (THP {transparent_huge_pages()})")
    for threads in (1, 2):
        small, huge = med[f"layers t{threads} small"], med[f"layers t{threads} huge"]
        print(f"{threads} thread(s): sum {med[f'sum t{threads}']:.1f} GB/s; layer matrices from 4 KB pages {small:.1f} "
              f"GB/s, from 2 MB pages {huge:.1f} GB/s ({huge / small:.2f}x)")
    for batch in (1, 8):
        small, huge = med[f"decode b{batch} small"], med[f"decode b{batch} huge"]
        print(f"decode step batch {batch}: 4 KB pages {small:.3f} ms, 2 MB pages {huge:.3f} ms ({small / huge:.2f}x)")


if __name__ == "__main__":
    main()
