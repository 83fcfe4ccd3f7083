"""Engine decode steps with another process taking part of a core, as a served worker's neighbours do.

    .venv/bin/python tests/bench/bench_step_noise.py [--rounds 2] [--steps 60] [--threads N]

On a small host the decode worker shares its cores with the router, Redis, Ray's daemons and often the client:
served at 8 concurrent chats here (`tandem loadgen --concurrency 8`, prompts of 120 tokens), the worker's decode
steps took 7.0 ms (its tandem_step_seconds) against 4.65 in a quiet process, while the router used ~20% of a core,
the client ~10-30% and the worker's own Ray and Redis threads ~7%. The step's thread team spins at its barriers,
so a core taken from either of its threads stalls both. This bench puts a number on that: decode-only steps (fresh
prompts of 100-160 tokens, batch 1 and 8, medians) in a quiet process and beside one busy-looping process that
takes a share of a core in 1 ms periods (busy 0.3 ms of each, then 0.5 ms), side by side each round. Printed:
the step, its slowdown against quiet, and the slowdown if the team only lost the CPU time taken (its threads
over the cores left to them, where they outnumber those).

Seen on the 2-vCPU EPYC (2026-11-28, memory in its fast state), 2 threads on the team (before the batch split):
batch 1 1.85 ms quiet, 1.37x beside 30% of a core, 1.80x beside 50% (1.18x and 1.33x if only the CPU were lost);
batch 8 4.31 ms, 1.45x, 1.83x. One thread: 2.67 and 5.56 ms, and no slower beside either (the neighbour takes the
other core). Spinning less (GOMP_SPINCOUNT, OMP_WAIT_POLICY=passive) or having the waiting worker yield its core did
not move the 2-thread figures. Later, back to back: batch 8 with the learned batch split (kernels/batch_split.py)
1.35x and 1.74x, with TANDEM_BATCH_SPLIT=0 1.49x and 2.02x (a split thread works on while the other is preempted).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.bench.bench_quant_decode import decode_step_seconds  # noqa: E402
from tests.bench.engine_steps import compiled_cpu_engine, step_bench_options  # noqa: E402

# A neighbour: busy for `busy` seconds, asleep for `idle`, until killed.
NEIGHBOUR = """
import sys, time
busy, idle = float(sys.argv[1]), float(sys.argv[2])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""
SHARES = {"quiet": None, "30% of a core": (0.0003, 0.0007), "50% of a core": (0.0005, 0.0005)}


def steps_beside(engine: object, share: tuple[float, float] | None, batch: int, steps: int,
                 rng: random.Random) -> float:
    """Median decode step (seconds) with a neighbour taking ``share`` (busy, idle seconds) of a core."""
    neighbour = None
    if share is not None:
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, *(str(s) for s in share)])
        time.sleep(0.2)
    try:
        return decode_step_seconds(engine, batch, steps, rng)  # type: ignore[arg-type]
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def main() -> None:
    args = step_bench_options(__doc__, rounds=2, steps=60)
    engine = compiled_cpu_engine(args.threads)
    rng = random.Random(0)
    decode_step_seconds(engine, 1, 8, rng)  # warm-up
    medians: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for name, share in SHARES.items():
            for batch in (1, 8):
                ms = steps_beside(engine, share, batch, args.steps, rng) * 1e3
                medians.setdefault((name, batch), []).append(ms)
                print(f"[bench] round {r + 1}: {name}, batch {batch}: {ms:.2f} ms", file=sys.stderr, flush=True)
    cores = os.cpu_count() or 1
    print(f"threads {args.threads} on {cores} cores; {args.rounds} rounds of {args.steps} decode steps; medians")
    print("| neighbour | batch | step ms | slowdown | if only the CPU taken |")
    print("| --- | --- | --- | --- | --- |")
    for (name, batch), values in medians.items():
        ms = statistics.median(values)
        quiet = statistics.median(medians[("quiet", batch)])
        share = SHARES[name]
        taken = 0.0 if share is None else share[0] / (share[0] + share[1])
        ideal = max(1.0, args.threads / (cores - taken))
        print(f"| {name} | {batch} | {ms:.2f} | {ms / quiet:.2f}x | {ideal:.2f}x |")


if __name__ == "__main__":
    main()
