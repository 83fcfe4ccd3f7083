"""Decode time a token at batch 1 and 8: Tandem's engine beside llama.cpp's on the same GGUF, this machine.

    .venv/bin/python tests/bench/bench_decode_vs_llama.py [--llama-server PATH] [--rounds 3] [--steps 64]

bench_quant_decode.py sets the engine's batch-1 step against the bytes it reads and its batch-8 step against
its batch-1 step (issue 20's targets). This puts the same two figures beside the reference a CPU user would
run: llama.cpp's ``llama-server`` (PEERS.md's recipe: ``-t`` as many threads as the engine, ``-np 8``) on the
bundled GGUF. Both decode fresh prompts of 100-160 random token ids (no prompt cache: ``cache_prompt`` off),
greedy, EOS ignored:
- Tandem: the default engine in this process, the median decode-only step (bench_quant_decode's measure);
- llama.cpp: its own timing of each request's generated tokens (``timings.predicted_per_token_ms``: the time
  from its first generated token to its last, a token; no HTTP in it), one request alone for batch 1, eight
  sent at once for batch 8 (their prompts go through in one batch first, then all eight decode together: one
  step a token each), the median of the eight.
In rounds (the host's pace drifts by the quarter hour), each round measuring both servers at both batches
back to back; the first round is a warm-up and not kept. Prints the medians, each server's batch-8 / batch-1
ratio (issue 20's second CPU target, <= 2, read on both), and how many times faster Tandem's token is at each
batch.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels import cpu_kernel  # noqa: E402
from tests.bench.bench_goodput import log, start_llama, stop, wait_ready  # noqa: E402
from tests.bench.bench_quant_decode import decode_step_seconds, random_prompt  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402

BATCHES = (1, 8)
PROMPT_LENS = (100, 160)
PORT = 8201


def per_round(numerators: list[float], denominators: list[float]) -> list[float]:
    """Each round's own ratio, sorted (median and range read off it)."""
    return sorted(x / y for x, y in zip(numerators, denominators, strict=True))


def llama_token_seconds(client: httpx.Client, url: str, batch: int, steps: int, rng: random.Random) -> float:
    """Median over ``batch`` requests sent at once of llama.cpp's own seconds a generated token."""
    prompts = [random_prompt(rng, PROMPT_LENS) for _ in range(batch)]

    def one(prompt: list[int]) -> float:
        r = client.post(f"{url}/completion", json={"prompt": prompt, "n_predict": steps, "temperature": 0,
                                                   "ignore_eos": True, "cache_prompt": False})
        r.raise_for_status()
        timings = r.json()["timings"]
        if timings["predicted_n"] != steps:
            raise RuntimeError(f"llama-server generated {timings['predicted_n']} tokens, not {steps}")
        return timings["predicted_per_token_ms"] / 1e3

    with ThreadPoolExecutor(batch) as pool:
        return statistics.median(pool.map(one, prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if not args.llama_server:
        sys.exit("no llama-server: build it with ../shared/PEERS.md's recipe; pass --llama-server PATH or set "
                 "LLAMA_SERVER")
    if not cpu_kernel.available():
        sys.exit(f"the compiled CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    log("loading the default engine (GGUF weights, the default KV cache)")
    engine = Engine(EngineConfig(num_kv_blocks=1024, enable_prefix_caching=False))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_decode_vs_llama-"))
    proc = start_llama(args.llama_server, PORT, log_dir, threads=args.threads)
    url = f"http://127.0.0.1:{PORT}"
    seconds: dict[tuple[str, int], list[float]] = {}
    try:
        wait_ready(url, proc, timeout_s=120)
        with httpx.Client(timeout=600) as client:
            for i in range(args.rounds + 1):
                got = {}
                for batch in BATCHES:
                    got["tandem", batch] = decode_step_seconds(engine, batch, args.steps, rng, PROMPT_LENS)
                    got["llama.cpp", batch] = llama_token_seconds(client, url, batch, args.steps, rng)
                log(f"round {i}{' (warm-up, not kept)' if i == 0 else ''}: "
                    + ", ".join(f"{name} b{b} {s * 1e3:.1f} ms" for (name, b), s in got.items()))
                if i > 0:
                    for key, s in got.items():
                        seconds.setdefault(key, []).append(s)
    finally:
        stop(proc)
    print(f"{args.threads} threads each; {args.rounds} rounds of {args.steps} tokens a request; ms a token "
          f"(median of rounds; ratios: median of each round's own, with their range); llama-server log in {log_dir}")
    print(f"{'server':<10} {'b1 ms':>7} {'b8 ms':>7} {'b8/b1':>6} {'rounds':>11} {'tok/s b1':>9} {'tok/s b8':>9}")
    for name in ("tandem", "llama.cpp"):
        b1, b8 = statistics.median(seconds[name, 1]), statistics.median(seconds[name, 8])
        ratios = per_round(seconds[name, 8], seconds[name, 1])
        print(f"{name:<10} {b1 * 1e3:7.1f} {b8 * 1e3:7.1f} {statistics.median(ratios):6.2f} "
              f"{ratios[0]:5.2f}-{ratios[-1]:<5.2f} {1 / b1:9.1f} {8 / b8:9.1f}")
    for batch in BATCHES:
        faster = per_round(seconds["llama.cpp", batch], seconds["tandem", batch])
        print(f"batch {batch}: tandem's token {statistics.median(faster):.2f}x as fast as llama.cpp's "
              f"(rounds {faster[0]:.2f}-{faster[-1]:.2f})")


if __name__ == "__main__":
    main()
