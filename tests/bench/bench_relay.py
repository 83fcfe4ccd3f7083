"""What relaying tokens from a decode worker costs the router: a Ray stream a request against a connection a
worker.

    .venv/bin/python tests/bench/bench_relay.py [--streams 32] [--tokens 256] [--rounds 3]

A decode worker actor (Ray, its own process, one core: a random-weight 2-layer model, so that the relay's share
is not lost in the steps) serves ``--streams`` greedy requests of ``--tokens`` tokens at once; this process
consumes them as a router does, no HTTP:
- per request: ``workers.actors.stream_generate``, one Ray streaming call a request, an item a token;
- per worker: ``router.worker_client.RayWorkerClient`` (what routers use), every request's chunks on one TCP
  connection a worker, a frame a decode step (workers/service/output_server.py).
Each round runs both, in turn; printed: tokens a second, this process's CPU a token (all its threads: Ray's
included) and the worker process's, medians over the rounds, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from router.worker_client import RayWorkerClient  # noqa: E402
from tests.bench.bench_router import tiny_model_dir  # noqa: E402
from workers.actors import start_decode_worker, stream_generate  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.model.open_model import open_model  # noqa: E402
from workers.model.tokenizer import Tokenizer  # noqa: E402
from workers.protocol.messages import GenerateRequest, TokenChunk  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402
from workers.resources import WorkerResources  # noqa: E402


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Stream = Callable[[GenerateRequest], AsyncIterator[TokenChunk]]


async def run_round(stream: Stream, streams: int, tokens: int, rng: random.Random, pid: int) -> tuple[float, ...]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one() -> int:
        prompt = [rng.randrange(3, 49000) for _ in range(32)]
        return sum([len(c.token_ids) async for c in stream(GenerateRequest(uuid.uuid4().hex, prompt, params))])

    worker0, own0, t0 = process_cpu_seconds(pid), own_cpu_seconds(), time.perf_counter()
    n = sum(await asyncio.gather(*(one() for _ in range(streams))))
    wall = time.perf_counter() - t0
    own, worker = own_cpu_seconds() - own0, process_cpu_seconds(pid) - worker0
    return n / wall, own / n * 1e6, worker / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tokenizer = Tokenizer.load(open_model(None).source)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as model_dir:
        config = EngineConfig(model=tiny_model_dir(tokenizer, Path(model_dir)), num_kv_blocks=4096, block_size=16)
        decode = start_decode_worker("d0", config, WorkerResources(num_cpus=1, torch_threads=1))
        pid = ray.get(decode.ready.remote())["pid"]
        client = RayWorkerClient(ray.get_runtime_context().namespace)
        ways: dict[str, Stream] = {"a Ray stream a request": lambda r: stream_generate(decode, r),
                                   "a connection a worker (routers)": lambda r: client.generate("d0", r)}
        rng = random.Random(0)

        async def rounds() -> dict[str, list[tuple[float, ...]]]:
            for stream in ways.values():  # warm both paths
                await run_round(stream, 4, 16, rng, pid)
            got: dict[str, list[tuple[float, ...]]] = {name: [] for name in ways}
            for i in range(args.rounds):
                for name, stream in ways.items():
                    got[name].append(await run_round(stream, args.streams, args.tokens, rng, pid))
                    rate, own, worker = got[name][-1]
                    print(f"[bench] round {i + 1} {name}: {rate:,.0f} tokens/s, router {own:.0f} us a token, "
                          f"worker {worker:.0f} us", file=sys.stderr, flush=True)
            return got

        results = asyncio.run(rounds())
        ray.shutdown()
    print(f"{args.streams} streams x {args.tokens} tokens, medians of {args.rounds} rounds")
    print(f"{'relay':<32} {'tokens/s':>9} {'router us/token':>16} {'worker us/token':>16}")
    medians = {name: [statistics.median(r[k] for r in rows) for k in range(3)] for name, rows in results.items()}
    for name, (rate, own, worker) in medians.items():
        print(f"{name:<32} {rate:>9,.0f} {own:>16.0f} {worker:>16.0f}")
    (old_rate, old_own, old_worker), (new_rate, new_own, new_worker) = medians.values()
    print(f"a connection a worker: {new_rate / old_rate:.2f}x the tokens/s, {old_own / new_own:.1f}x less router CPU "
          f"a token, {old_worker / new_worker:.2f}x less worker CPU a token")


if __name__ == "__main__":
    main()
