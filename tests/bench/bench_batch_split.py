"""The compiled decode stack's two ways of sharing a batch among the threads, side by side, and the engine's
steps with the way it learns (kernels/batch_split.py).

    .venv/bin/python tests/bench/bench_batch_split.py [--rounds 3] [--steps 30] [--threads N]

1. The stack alone (bench_step_team's stack_seconds: fresh random activations over a cache of the given context), median
   ms at batch 2, 4, 8 and 16, 170 and 450 tokens: **team** (every matrix's rows split among the threads, the
   batch together) and **split** (each thread its own rows through every layer), in turn within each round, with
   the memory's read bandwidth measured at the round's start: this VM's two vCPUs sit near (~50 GB/s) or far
   apart (~75 GB/s) by the quarter hour, and which way wins follows.
2. Engine decode steps at batch 8 (fresh prompts of 100-160 tokens, bench_quant_decode's) three ways: always the
   team, always split, and learned (what serves; one chooser for the whole run, as a worker keeps its own, so
   from round 2 on it has learned and explores one step in 64).
Printed per round; the ratios are split / team (below 1: the split is faster).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kernels.batch_split import BatchSplitChooser  # noqa: E402
from tests.bench.bench_quant_decode import decode_step_seconds, read_bandwidth  # noqa: E402
from tests.bench.bench_step_team import stack_seconds  # noqa: E402
from tests.bench.engine_steps import compiled_cpu_engine, step_bench_options  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402

CASES = [(2, 170), (4, 170), (8, 170), (16, 170), (8, 450), (16, 450)]


class Fixed(BatchSplitChooser):
    """Every step one way."""

    def __init__(self, split: bool):
        super().__init__()
        self.way = split

    def split(self, batch: int, threads: int) -> bool:
        return self.way


def engine_ms(engine: Engine, ways: BatchSplitChooser, steps: int, rng: random.Random) -> float:
    """Median ms of a batch-8 engine decode step with the stack's ways set to ``ways``."""
    model = engine.model
    stack = model.decoder_stack
    assert stack is not None
    model.decoder_stack = dataclasses.replace(stack, ways=ways)
    try:
        return decode_step_seconds(engine, 8, steps, rng) * 1e3
    finally:
        model.decoder_stack = stack


def main() -> None:
    args = step_bench_options(__doc__)
    engine = compiled_cpu_engine(args.threads)
    rng = random.Random(0)
    decode_step_seconds(engine, 1, 8, rng)  # warm-up
    print(f"threads {args.threads}; medians of {args.steps} calls; split / team below 1: the split is faster")
    learned = BatchSplitChooser()  # one for the run, as a worker keeps its own: it has learned by round 2
    for r in range(args.rounds):
        gbps = read_bandwidth() / 1e9
        cells = []
        for batch, context in CASES:
            team = stack_seconds(engine, batch, context, args.steps) * 1e3
            split = stack_seconds(engine, batch, context, args.steps, split=True) * 1e3
            cells.append(f"b{batch}/{context}: {team:.2f} / {split:.2f} ({split / team:.2f})")
        print(f"round {r + 1}, {gbps:.0f} GB/s, stack ms team / split: " + ", ".join(cells), flush=True)
        steps = {name: engine_ms(engine, ways, args.steps, rng)
                 for name, ways in (("team", Fixed(False)), ("split", Fixed(True)), ("learned", learned))}
        way = "split" if learned.ways().get(8) else "team"
        print(f"round {r + 1}, engine batch-8 step ms: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items())
              + f" (learned: {way} now)", flush=True)


if __name__ == "__main__":
    main()
