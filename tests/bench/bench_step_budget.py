"""A burst of prompts on a CPU engine under a step budget of 8,192 tokens against the CPU default (1,024).

    .venv/bin/python tests/bench/bench_step_budget.py [--burst 12] [--running 4] [--rounds 2] [--budgets 8192,1024]

What ``max_num_batched_tokens`` changes (``workers/engine/config.py`` DEFAULT_STEP_TOKENS), in one process, the
budgets taking turns on one engine each (the default model, no prefix cache): ``--running`` requests are decoding
when ``--burst`` new prompts of 200-500 tokens (seeded, new each round) arrive at once. Measured from the burst's
arrival until every burst prompt has its first token:
- each burst prompt's time to its first token (its TTFT, less the server around the engine), and how many got it
  within 2 s;
- the running streams' longest gap between two tokens (a stall a user watches);
- the time to get through the whole burst (the same work either way: a smaller budget hands it out in turn).
The engine's steps only: no HTTP, no Ray (``tests/bench/bench_goodput.py`` measures the served whole).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

TTFT_SLO_S = 2.0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


def one_burst(engine: Engine, rng: random.Random, burst: int, running: int) -> dict[str, float]:
    """Start ``running`` streams, let them decode, then add the burst and step until each burst prompt has a token."""
    stream = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request(prompt(rng, 300), stream) for _ in range(running)]
    for _ in range(running + 3):  # their prompts, then a few decode steps
        engine.step()
    last_token = dict.fromkeys(streams, time.perf_counter())
    longest_gap = 0.0
    arrived = time.perf_counter()
    waiting = {engine.add_request(prompt(rng, rng.randint(200, 500)), SamplingParams(max_tokens=4, temperature=0.0,
                                                                                      ignore_eos=True))
               for _ in range(burst)}
    ttfts: list[float] = []
    while waiting:
        outputs = engine.step().outputs
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in waiting:
                waiting.discard(out.request_id)
                ttfts.append(now - arrived)
            elif out.request_id in last_token:
                longest_gap = max(longest_gap, now - last_token[out.request_id])
                last_token[out.request_id] = now
    drained = time.perf_counter() - arrived
    for request_id in list(engine.scheduler.requests):  # the streams, and burst prompts still decoding
        engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()
    return {"ttft_p50": statistics.median(ttfts), "ttft_max": max(ttfts), "drained": drained,
            "within_slo": sum(t <= TTFT_SLO_S for t in ttfts), "first": min(ttfts), "stall": longest_gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=12)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets", default="8192,1024", help="step budgets to compare (tokens)")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    base = Engine(EngineConfig(num_kv_blocks=4096, enable_prefix_caching=False))
    engines = {b: Engine(EngineConfig(num_kv_blocks=4096, enable_prefix_caching=False, max_num_batched_tokens=b),
                         model=base.model, tokenizer=base.tokenizer) for b in budgets}
    default = base.scheduler.token_budget
    log(f"this CPU engine's default budget: {default} tokens")
    results: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    for r in range(args.rounds + 1):  # round 0 warms up
        for b in budgets:
            result = one_burst(engines[b], random.Random(1000 * r + 7), args.burst, args.running)
            if r:
                results[b].append(result)
                log(f"round {r} budget {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
    print(f"\nburst of {args.burst} prompts (200-500 tokens) while {args.running} streams decode; medians of "
          f"{args.rounds} rounds, seconds from the burst's arrival")
    print("| budget | first token, first prompt | TTFT p50 | TTFT max | prompts within 2 s | streams' longest stall "
          "| burst drained |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in budgets:
        med = {k: statistics.median(x[k] for x in results[b]) for k in results[b][0]}
        tag = " (default)" if b == default else ""
        print(f"| {b:,}{tag} | {med['first']:.2f} | {med['ttft_p50']:.2f} | {med['ttft_max']:.2f} | "
              f"{med['within_slo']:.0f} of {args.burst} | {med['stall']:.2f} | {med['drained']:.2f} |")


if __name__ == "__main__":
    main()
