"""The quantized linear kernels alone, per matrix of the bundled model, on each instruction set this CPU has.

    .venv/bin/python tests/bench/bench_quant_matrices.py [--rows 1,4,8,16] [--repeats 15] [--threads N]

A decode step multiplies 30 layers' qkv, o_proj, gate_up (Q4_1 by 8 rows) and down, and the Q8_0 head,
each against M rows of x (the batch). Each matrix shape is timed as 30 distinct copies (the head: once),
so the weights stream from memory as they do in a step, not from cache. Printed side by side for every
instruction set (``torch.ops.tandem_cpu.set_isa``): the median milliseconds a step spends in each
matrix, the total, its ratio to M = 1, and the speedup over AVX2. Random blocks: speed does not depend
on the values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import cpu_kernel  # noqa: E402
from kernels.cpu_kernel import instruction_sets  # noqa: E402
from kernels.quant_linear import BLOCK, QuantizedWeight, interleave, linear  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
QKV_ROWS = (9 + 3 + 3) * 64
# name: (format, rows, input width, copies a step)
MATRICES = {"qkv": ("q4_1", QKV_ROWS, HIDDEN, LAYERS), "o_proj": ("q4_1", HIDDEN, HIDDEN, LAYERS),
            "gate_up": ("q4_1", 2 * INTERMEDIATE, HIDDEN, LAYERS), "down": ("q4_1", HIDDEN, INTERMEDIATE, LAYERS),
            "head": ("q8_0", VOCAB, HIDDEN, 1)}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


def random_blocks(fmt: str, rows: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    nb = k // BLOCK
    data = torch.randint(0, 256, (rows, nb, BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=gen)
    scales = 2 if fmt == "q4_1" else 1  # d (and m): finite fp16 values
    data[:, :, : 2 * scales] = (torch.rand(rows, nb, scales, generator=gen) * 0.01).half().view(torch.uint8)
    return interleave(QuantizedWeight(fmt, data.reshape(rows, -1), k))


def time_matrix(weights: list[QuantizedWeight], x: torch.Tensor, repeats: int) -> float:
    """Median seconds for one pass over every copy."""
    for w in weights:
        linear(x, w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            linear(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16", help="rows of x (batch sizes)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernel.available():
        sys.exit(f"the CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    weights = {name: [random_blocks(fmt, n, k, gen) for _ in range(copies)]
               for name, (fmt, n, k, copies) in MATRICES.items()}
    isas = instruction_sets()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}; instruction sets {', '.join(isas)}; ms a step, median of "
          f"{args.repeats}")
    totals: dict[tuple[str, int], float] = {}
    print(f"{'isa':<12} {'M':>3} " + " ".join(f"{n:>8}" for n in MATRICES) + f" {'total':>8} {'/M=1':>6}")
    for isa in isas:
        torch.ops.tandem_cpu.set_isa(isa)
        for m in rows:
            x = torch.randn(m, max(k for _, _, k, _ in MATRICES.values()), generator=gen)
            ms = {name: 1e3 * time_matrix(ws, x[:, : ws[0].in_features].contiguous(), args.repeats)
                  for name, ws in weights.items()}
            totals[isa, m] = sum(ms.values())
            per_one = totals[isa, m] / totals[isa, rows[0]]
            print(f"{isa:<12} {m:>3} " + " ".join(f"{v:8.2f}" for v in ms.values())
                  + f" {totals[isa, m]:8.2f} {per_one:6.2f}")
    torch.ops.tandem_cpu.set_isa("best")
    for isa in isas[1:]:
        print(f"{isa} speedup over avx2: "
              + ", ".join(f"M={m} {totals['avx2', m] / totals[isa, m]:.2f}x" for m in rows))


if __name__ == "__main__":
    main()
