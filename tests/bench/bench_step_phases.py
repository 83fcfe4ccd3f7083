"""Where a CPU decode step's time goes: the compiled layer stack phase by phase, and the step around it.

    .venv/bin/python tests/bench/bench_step_phases.py [--rounds 3] [--steps 30] [--threads N]

1. The stack (kernels/csrc/decoder_cpu.cpp) with its phase clock on (``set_stack_phase_timing``: the leader's
   wall time in each part of a layer; a matrix's part holds quantizing its x and waiting on the team): microseconds
   a layer, at batch 1 and 8, at 170 and 450 tokens of context (bench_step_team's stack calls). With gate_up paired
   (quant_linear.pair_gate_up, the default for GGUF weights) its SiLU runs inside the matrix: "silu" books ~0.
2. Engine decode steps at batch 1 and 8 (fresh prompts of 100-160 tokens, no prefix cache) split into the stack,
   the head (final norm and the tied Q8_0 matrix), the rest of the forward (embedding, RoPE tables) and the host
   (schedule, inputs, argmax, postprocess).
Medians over rounds; this machine's pace drifts by the quarter hour, so read the parts against each other.

Seen on a 2-vCPU AVX-512 EPYC (2026-11-28), memory in its fast state (~70 GB/s), us a layer at ctx 170:
batch 1: norms 1.4, qkv 5.5, attention 3.7-5.4, o_proj 3.1-4.3, gate_up 13-15, SiLU 0.3-0.8, down 6.6-9 (the
matrices stream at the read bandwidth); batch 8: norms 4.4-5.4, qkv 11-15, attention 22-29, o_proj 6.3-9, gate_up
25-28, SiLU 2-5, down 15-19 (bound by the kernels' instructions). A batch-1 step ~1.9-2.2 ms: stack 1.15-1.35,
head 0.55-0.6, host 0.19.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.bench.bench_quant_decode import random_prompt  # noqa: E402
from tests.bench.bench_step_team import stack_seconds  # noqa: E402
from tests.bench.engine_steps import PartTimer, compiled_cpu_engine, step_bench_options  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

CASES = [(1, 170), (8, 170), (8, 450)]  # (batch, context) of the stack alone


def stack_phases(engine: Engine, batch: int, context: int, steps: int) -> dict[str, float]:
    """Microseconds a layer in each phase, and the stack's median milliseconds under "stack ms"."""
    layers = engine.model.config.num_layers
    stack_seconds(engine, batch, context, 3)  # warm: the team learns its splits for this batch
    torch.ops.tandem_cpu.stack_phase_seconds(True)
    median = stack_seconds(engine, batch, context, steps)
    phases = torch.ops.tandem_cpu.stack_phase_seconds(True)
    out = {name: seconds / steps / layers * 1e6 for name, seconds in phases.items()}
    out["stack ms"] = median * 1e3
    return out


def step_parts(engine: Engine, timer: PartTimer, batch: int, steps: int, rng: random.Random) -> dict[str, float]:
    """Milliseconds a decode-only step at ``batch``: the whole, its stack (the phase clock's sum, on), head and rest
    of the forward, and the host's part."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(random_prompt(rng, (100, 160)), params)
    total, counted, stack = 0.0, 0, 0.0
    sums = dict.fromkeys(timer.seconds, 0.0)
    while engine.has_unfinished and counted < steps:
        before = dict(timer.seconds)
        torch.ops.tandem_cpu.stack_phase_seconds(True)
        t0 = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - t0
        if result.is_decode_only and result.num_tokens == batch:
            total += elapsed
            counted += 1
            stack += sum(torch.ops.tandem_cpu.stack_phase_seconds(True).values())  # the stack's layers, all phases
            for name in sums:
                sums[name] += timer.seconds[name] - before[name]
    while engine.has_unfinished:
        engine.step()
    ms = {name: s / counted * 1e3 for name, s in sums.items()}
    stack_ms = stack / counted * 1e3
    return {"step": total / counted * 1e3, "stack": stack_ms, "head": ms["head"],
            "rest of forward": ms["forward"] - stack_ms - ms["head"], "host": (total / counted * 1e3) - ms["forward"]}


def main() -> None:
    args = step_bench_options(__doc__)
    engine = compiled_cpu_engine(args.threads)
    model = engine.model
    assert model.decoder_stack is not None, "the default model's GGUF weights take the compiled stack"
    timer = PartTimer({"head": (model, "_logits"), "forward": (model, "forward")})
    rng = random.Random(0)
    step_parts(engine, timer, 1, 4, rng)  # warm-up
    phases: dict[tuple[int, int], list[dict[str, float]]] = {}
    steps: dict[int, list[dict[str, float]]] = {}
    was = torch.ops.tandem_cpu.set_stack_phase_timing(True)
    try:
        for _ in range(args.rounds):
            for batch, context in CASES:
                phases.setdefault((batch, context), []).append(stack_phases(engine, batch, context, args.steps))
            for batch in (1, 8):
                steps.setdefault(batch, []).append(step_parts(engine, timer, batch, args.steps, rng))
    finally:
        torch.ops.tandem_cpu.set_stack_phase_timing(was)
    print(f"threads {args.threads}; {args.rounds} rounds of {args.steps} calls; medians")
    names = list(phases[CASES[0]][0])
    print("stack, us a layer: " + " | ".join(f"{n:>9}" for n in ["batch", "context", *names]))
    for (batch, context), rounds in phases.items():
        row = [statistics.median(r[n] for r in rounds) for n in names]
        print("                   " + " | ".join([f"{batch:>9}", f"{context:>9}", *(f"{v:9.2f}" for v in row)]))
    parts = list(steps[1][0])
    print("engine step, ms:   " + " | ".join(f"{n:>15}" for n in ["batch", *parts]))
    for batch, rounds in steps.items():
        row = [statistics.median(r[n] for r in rounds) for n in parts]
        print("                   " + " | ".join([f"{batch:>15}", *(f"{v:15.3f}" for v in row)]))


if __name__ == "__main__":
    main()
