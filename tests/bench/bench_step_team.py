"""The compiled decode layer stack without its thread team, with it, and with the team's workers prefetching
the next matrix, side by side in one run.

    .venv/bin/python tests/bench/bench_step_team.py [--rounds 6] [--steps 40] [--context 170]

A decode step on CPU runs ~150 parallel loops (5 a layer: 4 matrices and attention). Without the team each
opens an OpenMP region (at::parallel_for); with it (kernels/csrc/thread_team.h) one region is held open for
the step and each loop hands its range to threads already spinning; with its prefetch plan, a waiting worker
pulls its share of the next matrix into its cache. Measured on the default model's layer stack (30 layers, GGUF
blocks, int8 KV cache) at batch 1 and 8: the median of ``--steps`` stack calls, the three taking turns round by
round (this machine's pace drifts by the quarter hour), then each one's median over the rounds and its speedup
over no team. Figures are the stack alone: the final norm, the head and the engine's host work are outside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.engine_steps import compiled_cpu_engine  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402

# name: (step team on, its workers' prefetch plan on)
CONFIGS = {"no team": (False, False), "team": (True, False), "team + prefetch": (True, True)}


def stack_seconds(engine: Engine, batch: int, context: int, steps: int, split: bool = False) -> float:
    """Median seconds of the compiled stack over ``batch`` sequences of ``context`` tokens (the last one new), on
    the team (every matrix's rows split among the threads) or, ``split``, the batch's rows split among them: one
    way, not the one the stack learns as it serves (kernels/batch_split.py)."""
    model = engine.model
    cfg = model.config
    stack = model.decoder_stack
    assert stack is not None, "the default model's GGUF weights take the compiled stack"
    kv = engine.runner.kv_cache
    block = kv.shape[3]
    blocks = -(-context // block)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    slots = (tables[:, (context - 1) // block] * block + (context - 1) % block).long()
    lens = torch.full((batch,), context, dtype=torch.int32)
    cos, sin = model.rope.cos_sin(torch.full((batch,), context - 1))
    h0 = torch.randn(batch, cfg.hidden_size)
    times = []
    for _ in range(steps):
        h = h0.clone()
        t0 = time.perf_counter()
        stack.run_(h, cos, sin, kv, slots, tables, lens, scale=model.scale, eps=cfg.rms_norm_eps, split=split)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    engine = compiled_cpu_engine(args.threads)
    print(f"threads {args.threads}; {args.rounds} rounds of {args.steps} stack calls, context {args.context}; "
          f"{', '.join(CONFIGS)} taking turns")
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not kept
        for batch in (1, 8):
            for name, (team, prefetch) in CONFIGS.items():
                torch.ops.tandem_cpu.set_step_team(team)
                torch.ops.tandem_cpu.set_team_prefetch(prefetch)
                results.setdefault((batch, name), []).append(
                    stack_seconds(engine, batch, args.context, args.steps))
    torch.ops.tandem_cpu.set_step_team(True)
    torch.ops.tandem_cpu.set_team_prefetch(True)
    # Speedups: each against no team, and the prefetch plan's own against the team without it.
    ratios = [("no team", "team"), ("no team", "team + prefetch"), ("team", "team + prefetch")]
    print(f"{'batch':>5} " + " ".join(f"{name + ' ms':>20}" for name in CONFIGS)
          + " " + " ".join(f"{a + ' / ' + b:>26}" for a, b in ratios))
    for batch in (1, 8):
        ms = {name: 1e3 * statistics.median(results[(batch, name)][1:]) for name in CONFIGS}
        print(f"{batch:>5} " + " ".join(f"{v:20.3f}" for v in ms.values())
              + " " + " ".join(f"{ms[a] / ms[b]:26.3f}" for a, b in ratios))


if __name__ == "__main__":
    main()
