"""A decode step where a worker runs it (its engine thread) against where a benchmark runs it (the main thread).

    .venv/bin/python tests/bench/bench_served_step.py [--threads 2] [--tokens 128]

A worker builds its model on one thread and steps the engine on another (``workers/service/engine_loop.py``).
OpenMP thread teams belong to the thread that opens them, so that can leave a process with two teams. libgomp
spins between parallel regions only while the process has no more OpenMP threads than cores; past that it
sleeps on a futex, and a decode step, a few hundred parallel regions, pays a wake-up for each. Each case runs
in a fresh process (OMP_NUM_THREADS is read at start), greedy batch-1 decode of a short prompt, median step:
1. main: the engine built and stepped on the main thread;
2. engine thread, two teams: built on the main thread with N threads, stepped on another (the workers before);
3. engine thread, one team: OMP_NUM_THREADS=1 for the process, N threads on the engine thread alone (the
   workers now: ``workers/actors.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(threads: int, tokens: int, on_engine_thread: bool) -> float:
    """Median seconds of a decode step (run inside the case's own process)."""
    import torch

    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.protocol.sampling_params import SamplingParams

    engine = Engine(EngineConfig(num_kv_blocks=256))
    steps: list[float] = []

    def run() -> None:
        torch.set_num_threads(threads)
        for round_ in range(2):  # the first round warms up
            engine.add_request(engine.tokenizer.encode(f"Story {round_}: once upon a time"),
                               SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0))
            times = []
            while engine.has_unfinished:
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            steps[:] = times[1:]  # the first step is the prompt's

    if on_engine_thread:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    return statistics.median(steps)


def case(name: str, threads: int, tokens: int, omp: str, on_engine_thread: bool) -> float:
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r});"
            "from bench_served_step import measure;"
            f"print(json.dumps(measure({threads}, {tokens}, {on_engine_thread})))")
    env = {**os.environ, "OMP_NUM_THREADS": omp}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    seconds = float(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{name:<38} {seconds * 1000:7.2f} ms", flush=True)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    print(f"batch-1 decode step, median of {args.tokens - 1}, {args.threads} torch threads")
    main_thread = case("main thread", args.threads, args.tokens, str(args.threads), False)
    two = case("engine thread, two OpenMP teams", args.threads, args.tokens, str(args.threads), True)
    one = case("engine thread, one OpenMP team", args.threads, args.tokens, "1", True)
    print(f"two teams / one team: {two / one:.2f}x; one team / main thread: {one / main_thread:.2f}x")


if __name__ == "__main__":
    main()
