"""Engine steps with the quantized matrices on AMX tiles against the 512-bit VNNI loops, side by side.

    .venv/bin/python tests/bench/bench_amx_decode.py [--batches 8,12,16,24,32] [--steps 40] [--prompts 6] [--prompt 400]

"amx" (kernels/csrc/quant_x8_amx.h) multiplies on tiles from ``amx_min_rows()`` rows of x; "avx512_vnni" never.
Both read the same weights (x8p), so one engine (the default model, GGUF blocks, int8 KV cache, no prefix cache)
switches between them step for step: this machine's pace drifts by the minute (whole rounds of one set, then
the other, gave the same code 0.84-1.31x apart), so the sets alternate step by step and each pair of neighbouring
steps gives a ratio. Measured:
1. decode-only steps at each batch (fresh prompts of 100-160 tokens), the sets alternating step by step;
2. a prefill of one fresh 400-token prompt alone (its first step: a time to first token without queueing), the
   sets alternating prompt by prompt.
Printed: each set's median step and the median of the pairs' ratios (amx / avx512_vnni) with their quartiles.
Exits where the CPU or its OS gives no AMX tiles.
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
from tests.bench.bench_quant_decode import cpu_model, decode_step_seconds, random_prompt  # noqa: E402
from tests.bench.engine_steps import compiled_cpu_engine  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

SETS = ("avx512_vnni", "amx")


def prefill_seconds(engine: Engine, rng: random.Random, tokens: int) -> float:
    """The first step of one fresh prompt of ``tokens`` tokens, alone in the engine (its whole prefill)."""
    engine.add_request(random_prompt(rng, (tokens, tokens + 1)), SamplingParams(max_tokens=1, temperature=0.0))
    t0 = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t0
    while engine.has_unfinished:
        engine.step()
    return seconds


def alternating_decode_steps(engine: Engine, batch: int, steps: int, rng: random.Random) -> dict[str, list[float]]:
    """Seconds of decode-only steps at ``batch``, the sets taking turns step by step (the first steps of each set)."""
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0.0)
    for _ in range(batch):
        engine.add_request(random_prompt(rng, (100, 160)), params)
    times: dict[str, list[float]] = {isa: [] for isa in SETS}
    turn = 0
    while engine.has_unfinished and len(times[SETS[-1]]) < steps:
        isa = SETS[turn % 2]
        with cpu_kernel.instruction_set(isa):
            t0 = time.perf_counter()
            result = engine.step()
            elapsed = time.perf_counter() - t0
        if result.is_decode_only and result.num_tokens == batch:
            times[isa].append(elapsed)
            turn += 1
    while engine.has_unfinished:
        engine.step()
    return times


def pair_ratios(times: dict[str, list[float]]) -> list[float]:
    return sorted(a / v for v, a in zip(times["avx512_vnni"], times["amx"], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,12,16,24,32")
    parser.add_argument("--steps", type=int, default=40, help="decode steps of each set at each batch")
    parser.add_argument("--prompts", type=int, default=6, help="prefills of each set (0: none)")
    parser.add_argument("--prompt", type=int, default=400, help="tokens of the prefill measured")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.steps < 1 or args.prompts < 0:
        parser.error("--steps must be at least 1 and --prompts at least 0")
    engine = compiled_cpu_engine(args.threads)
    if "amx" not in cpu_kernel.instruction_sets():
        sys.exit("this CPU (or its OS) gives no AMX-INT8 tiles")
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    decode_step_seconds(engine, 8, 4, rng)  # warm-up: the process meets its shapes
    with cpu_kernel.instruction_set("amx"):
        tiles_from = torch.ops.tandem_cpu.amx_min_rows()
    print(f"{cpu_model()}; threads {args.threads}; amx on tiles from {tiles_from} rows of x; ms")
    print("| step | pairs | avx512_vnni | amx | amx / avx512_vnni: median of pairs (quartiles) |")
    print("| --- | --- | --- | --- | --- |")
    rows: list[tuple[str, dict[str, list[float]]]] = []
    for batch in batches:
        rows.append((f"decode b{batch}", alternating_decode_steps(engine, batch, args.steps, rng)))
    if args.prompts > 0:  # --prompts 0: decode steps only
        prefill: dict[str, list[float]] = {isa: [] for isa in SETS}
        for i in range(2 * args.prompts):
            with cpu_kernel.instruction_set(SETS[i % 2]):
                prefill[SETS[i % 2]].append(prefill_seconds(engine, rng, args.prompt))
        rows.append((f"prefill {args.prompt}", prefill))
    for name, times in rows:
        ratios = pair_ratios(times)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"| {name} | {len(ratios)} | {statistics.median(times['avx512_vnni']) * 1e3:.2f} | "
              f"{statistics.median(times['amx']) * 1e3:.2f} | {q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
