"""TTFT of a 1,000-token prompt through 1 prefill + 1 decode Ray actor, against one engine (idle system).

    .venv/bin/python tests/bench/bench_disagg.py [--repeats 5]

Each repeat uses a fresh prompt (no prefix-cache hits anywhere). The single engine runs in this
process; the workers are local Ray actors on the same CPU, each with the same torch thread count,
and only one request is in flight at a time. The rounds are interleaved (each path once per round,
back to back); prints medians and the median of per-round overhead ratios per transport.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
import torch  # noqa: E402

from tests.prompts import text_of_tokens  # noqa: E402
from workers.actors import start_decode_worker, start_prefill_worker, stream_generate  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.messages import GenerateRequest  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402
from workers.resources import WorkerResources  # noqa: E402
from workers.transport.nixl import nixl_available  # noqa: E402

PROMPT_TOKENS = 1000
THREADS = os.cpu_count() or 1
CONFIG = EngineConfig(kv_cache_bytes=256 << 20)
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def prompts(engine: Engine, repeats: int, offset: int) -> list[list[int]]:
    """Prompts that share no leading block with any other (the request number comes first)."""
    tok = engine.tokenizer
    return [tok.encode(f"Request {offset + i}. " + text_of_tokens(tok, PROMPT_TOKENS, seed=i))[:PROMPT_TOKENS]
            for i in range(repeats)]


def engine_ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(prompt, PARAMS)
    while not any(out.new_token_ids for out in engine.step().outputs):
        pass
    seconds = time.perf_counter() - t0
    while engine.has_unfinished:
        engine.step()
    return seconds


def disagg_ttft(decode: object, prompt: list[int], rid: str, prefill_worker: str | None) -> float:
    async def run() -> float:
        t0 = time.perf_counter()
        stream = stream_generate(decode, GenerateRequest(rid, prompt, PARAMS, None, prefill_worker))
        await anext(stream)
        seconds = time.perf_counter() - t0
        async for _ in stream:
            pass
        return seconds

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    engine = Engine(CONFIG)
    engine_ttft(engine, prompts(engine, 1, 999)[0])  # warm-up
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    resources = WorkerResources(num_cpus=1, torch_threads=THREADS)
    paths: dict[str, Callable[[list[int], str], float]] = {
        "one engine (this process)": lambda p, _: engine_ttft(engine, p)}
    actors = []
    for transport in ["tcp"] + (["nixl"] if nixl_available() else []):
        prefill = start_prefill_worker(f"bench-p-{transport}", CONFIG, resources, transport)
        decode = start_decode_worker(f"bench-d-{transport}", CONFIG, resources, transport)
        ray.get([prefill.ready.remote(), decode.ready.remote()])
        actors += [prefill, decode]
        paths[f"1P+1D Ray actors, {transport}"] = (
            lambda p, rid, d=decode, name=f"bench-p-{transport}": disagg_ttft(d, p, rid, name))
        if transport == "tcp":
            paths["decode actor, local prefill"] = lambda p, rid, d=decode: disagg_ttft(d, p, rid, None)
    # The machine is shared and noisy: every round runs each path once, back to back, on fresh prompts;
    # the ratios are medians of per-round ratios.
    all_prompts = prompts(engine, (args.repeats + 1) * len(paths), 0)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.repeats + 1):
        for k, (name, fn) in enumerate(paths.items()):
            seconds = fn(all_prompts[r * len(paths) + k], f"r{r}-{k}")
            if r:  # round 0 warms up every path
                times[name].append(seconds)
        print(f"round {r}: " + ", ".join(f"{ts[-1] * 1e3:.0f}" for ts in times.values() if r), flush=True)
    for actor in actors:
        ray.kill(actor)
    ray.shutdown()
    base = times["one engine (this process)"]
    print(f"TTFT of a {PROMPT_TOKENS}-token prompt, {args.repeats} interleaved rounds, medians, "
          f"{THREADS} torch threads")
    print("| path | TTFT | vs one engine | target |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        target = "<= 1.15x" if name.startswith("1P+1D") else ""
        ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        print(f"| {name} | {statistics.median(ts) * 1e3:.0f} ms | {ratio:.2f}x | {target} |")


if __name__ == "__main__":
    main()
