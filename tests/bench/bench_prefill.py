"""Prefill on this CPU: where a prompt's time goes, and the compiled prefill attention beside SDPA.

    .venv/bin/python tests/bench/bench_prefill.py [--tokens 500] [--prefix 32] [--repeats 5]

On the default cluster prefill shares the cores with decode, so every millisecond of it also stretches the
running requests' TPOT. Measured side by side in one run:
1. the engine prefilling a fresh random prompt of --tokens tokens (no prefix shared: caches cold), and one
   of --tokens new tokens after a cached prefix of --prefix tokens (the chat template's system prompt hits
   the prefix cache this way), median ms, split by torch.profiler into the quantized matrices (gate_up's with
   its SiLU), attention, and the rest;
2. one layer's attention over the paged int8 cache (the default), for a whole prompt and for the prompt after the
   cached prefix: the compiled kernel (``kernels/csrc/paged_prefill_cpu.cpp``, what runs) on each instruction set
   this CPU has (its 256-bit loops, and its 512-bit ones on "avx512_vnni"), against SDPA over the gathered, widened
   cache (``kernels.torch_paged``, what ran before; a cached prefix needs an explicit mask there), median of
   --repeats x 10 calls alternated, and their ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kernels import cpu_kernel, kv_quant  # noqa: E402
from kernels.torch_paged import paged_prefill_attention_torch  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the bundled model's attention
GROUPS = {"matrices": tuple(f"tandem_cpu::{fmt}_linear{op}" for fmt in ("q4_1x8", "q8_0x8", "q4_1x8p", "q8_0x8p")
                             for op in ("", "_silu")),  # gate_up's with its SiLU (quant_linear.linear_silu)
          "attention": ("tandem_cpu::paged_prefill_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                        "aten::_scaled_dot_product_attention_math")}


def prefill_ms(engine: Engine, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    return (time.perf_counter() - t0) * 1e3


def split_ms(engine: Engine, prompts: list[list[int]]) -> dict[str, float]:
    """Each group's self time a prompt, from torch.profiler over the prompts."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for p in prompts:
            prefill_ms(engine, p)
    out = dict.fromkeys(GROUPS, 0.0)
    for event in prof.key_averages():
        for group, names in GROUPS.items():
            if event.key in names:
                out[group] += event.self_cpu_time_total / 1e3 / len(prompts)
    return out


def attention_ab(tokens: int, prefix: int, repeats: int) -> dict[str, float]:
    """ms a layer for ``tokens`` new queries after ``prefix`` cached tokens: the compiled kernel on each instruction
    set this CPU has (256-bit loops; 512-bit ones on "avx512_vnni"), and the SDPA path."""
    seq_len = prefix + tokens
    blocks = (seq_len + BLOCK - 1) // BLOCK
    gen = torch.Generator().manual_seed(0)
    k_cache = kv_quant.quantize_rows(torch.randn(blocks * 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
    v_cache = kv_quant.quantize_rows(torch.randn(blocks * 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
    table = torch.randperm(blocks * 4, generator=gen)[:blocks].int().unsqueeze(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    scale = HEAD_DIM ** -0.5

    def compiled(isa: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with cpu_kernel.instruction_set(isa):
                return cpu_kernel.paged_prefill_attention(q, k_cache, v_cache, table, qsl, lens, scale=scale)
        return run

    def sdpa() -> torch.Tensor:
        return paged_prefill_attention_torch(q, k_cache, v_cache, table, qsl, lens, scale=scale)

    paths = {**{isa: compiled(isa) for isa in cpu_kernel.instruction_sets()}, "SDPA": sdpa}
    for name, fn in paths.items():
        assert (fn() - sdpa()).abs().max().item() < 1e-4, f"{name} and SDPA disagree"
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():  # alternated: the machine's drift hits all
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            times[name].append((time.perf_counter() - t0) * 100)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--prefix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernel.available():
        sys.exit(f"the compiled CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    engine = Engine(EngineConfig(num_kv_blocks=1024))  # the default engine: quantized weights, int8 cache
    prefill_ms(engine, fresh(args.tokens))  # warm-up: the process meets its shapes
    system = fresh(args.prefix)
    prefill_ms(engine, system)  # now cached (whole blocks of it)
    print(f"threads {args.threads}; prefill of {args.tokens} new tokens, median of {args.repeats}")
    print(f"{'prompt':<28} {'total ms':>9} {'matrices':>9} {'attention':>10} {'rest':>7}")
    for name, make in ((f"{args.tokens} fresh", lambda: fresh(args.tokens)),
                       (f"{args.prefix} cached + {args.tokens} new", lambda: system + fresh(args.tokens))):
        total = statistics.median(prefill_ms(engine, make()) for _ in range(args.repeats))
        parts = split_ms(engine, [make() for _ in range(2)])
        rest = total - sum(parts.values())
        print(f"{name:<28} {total:9.1f} {parts['matrices']:9.1f} {parts['attention']:10.1f} {rest:7.1f}")
    print(f"one layer's attention over the int8 cache, ms ({args.repeats} x 10 calls, alternated):")
    for prefix in (0, args.prefix):
        ms = attention_ab(args.tokens, prefix, args.repeats)
        best = cpu_kernel.instruction_sets()[-1]
        print(f"  {args.tokens} new after {prefix} cached: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
              + f"; SDPA / {best} {ms['SDPA'] / ms[best]:.2f}x, avx2 / {best} {ms['avx2'] / ms[best]:.2f}x")


if __name__ == "__main__":
    main()
