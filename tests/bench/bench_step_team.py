"""The compiled decode layer stack with and without its thread team, side by side in one run.

    .venv/bin/python tests/bench/bench_step_team.py [--rounds 6] [--steps 40] [--context 170]

A decode step on CPU runs ~150 parallel loops (5 a layer: 4 matrices and attention). Without the team each
opens an OpenMP region (at::parallel_for); with it (kernels/csrc/thread_team.h) one region is held open for
the step and each loop hands its range to threads already spinning. Measured on the default model's layer
stack (30 layers, GGUF blocks, int8 KV cache) at batch 1 and 8: the median of ``--steps`` stack calls, team on
and off alternating round by round (this machine's pace drifts by the quarter hour), then each side's median
over the rounds and the ratio. Figures are the stack alone: the final norm, the head and the engine's host
work are outside it.
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

from kernels import cpu_kernel  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402


def stack_seconds(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Median seconds of the compiled stack over ``batch`` sequences of ``context`` tokens (the last one new)."""
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
        stack.run_(h, cos, sin, kv, slots, tables, lens, scale=model.scale, eps=cfg.rms_norm_eps)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernel.available():
        sys.exit(f"the compiled CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    engine = Engine(EngineConfig(weight_format="gguf", num_kv_blocks=1024, enable_prefix_caching=False))
    print(f"threads {args.threads}; {args.rounds} rounds of {args.steps} stack calls, context {args.context}; "
          f"team off and on alternating")
    results: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not kept
        for batch in (1, 8):
            for team in (False, True):
                torch.ops.tandem_cpu.set_step_team(team)
                results.setdefault((batch, team), []).append(
                    stack_seconds(engine, batch, args.context, args.steps))
    torch.ops.tandem_cpu.set_step_team(True)
    print(f"{'batch':>5} {'team off ms':>12} {'team on ms':>11} {'saved ms':>9} {'off/on':>7}")
    for batch in (1, 8):
        off = statistics.median(results[(batch, False)][1:])
        on = statistics.median(results[(batch, True)][1:])
        print(f"{batch:>5} {off * 1e3:12.3f} {on * 1e3:11.3f} {(off - on) * 1e3:9.3f} {off / on:7.3f}")


if __name__ == "__main__":
    main()
