"""Router benchmarks: prefix-aware routing against round-robin, and the router's own overhead.

    .venv/bin/python tests/bench/bench_router.py prefix [--suffixes 12] [--trials 3]
    .venv/bin/python tests/bench/bench_router.py overhead [--repeats 50]

prefix: 8 system prompts of ~1,000 tokens, many short suffixes, 2 prefill workers and 1 decode
worker (in-process services, KV over tcp, a random-weight 8-layer model so that the 2-core machine
finishes), each prefill worker's KV pool holding about 5 of the 8 system prompts. The same shuffled
requests (4 in flight) go through a router per policy, and through two prefix-aware routers
sharing one Redis with requests alternating between them. Prefill on the decode worker is turned
off so every prompt is routed to a prefill worker. Hit tokens are the prefill workers' prefix-cache
hits; the ideal is every request but the first of each system prompt reusing its full blocks.

overhead: TTFT of a short prompt through the router over HTTP against calling the decode worker
directly, one request at a time. As ``tandem serve`` deploys it, the decode worker is a Ray actor
(a random-weight 2-layer model, so that the router's share is not lost in the step) and the router
reaches it through Ray; the direct path calls the same actor the same way from this process. Also
``PrefixIndex.match`` on an 8K-token prompt with 16 workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402

from cluster.embedded_redis import EmbeddedRedis  # noqa: E402
from router.policy import PolicyConfig  # noqa: E402
from router.prefix_index import PrefixIndex  # noqa: E402
from router.state import RouterConfig  # noqa: E402
from router.worker_client import LocalWorkerClient  # noqa: E402
from tests.router.serve import AppServer, serve_app, serve_router  # noqa: E402
from tests.tiny_model import tiny_model  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.model.llama import LlamaModel  # noqa: E402
from workers.model.open_model import open_model  # noqa: E402
from workers.model.tokenizer import Tokenizer  # noqa: E402
from workers.protocol.block_hash import hash_prompt_blocks  # noqa: E402
from workers.protocol.messages import GenerateRequest  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402
from workers.service.decode import DecodeService  # noqa: E402
from workers.service.prefill import PrefillService  # noqa: E402
from workers.service.prefill_clients import LocalPrefillClient  # noqa: E402
from workers.service.publisher import PublishConfig  # noqa: E402
from workers.transport.tcp import TcpTransport  # noqa: E402

BS = 16
SYSTEM_TOKENS = 1000
NUM_SYSTEMS = 8
MODEL = tiny_model(num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32)


def remote_prefill_only(policy: str) -> PolicyConfig:
    """Every prompt routed to a prefill worker (never prefilled on the decode worker: the other policies never
    prefill locally, and refuse the knobs)."""
    if policy != "prefix_aware":
        return PolicyConfig(policy)
    return PolicyConfig(policy, local_prefill_max_tokens=0, local_prefill_min_overlap=1.01)


class Cluster:
    """2 prefill + 1 decode services publishing to Redis under a fresh cluster name."""

    def __init__(self, redis_url: str, tokenizer: Tokenizer, prefill_blocks: int, model: LlamaModel = MODEL):
        self.name = f"bench-{uuid.uuid4().hex[:6]}"
        publish = PublishConfig(redis_url, self.name)

        def engine(blocks: int) -> Engine:
            return Engine(EngineConfig(num_kv_blocks=blocks, block_size=BS, max_model_len=2048), model=model,
                          tokenizer=tokenizer)

        self.prefill = {
            f"p{i}": PrefillService(engine(prefill_blocks), TcpTransport(), f"p{i}", publish=publish).start()
            for i in range(2)}
        self.decode = {"d0": DecodeService(engine(4096), TcpTransport(), "d0", LocalPrefillClient(self.prefill),
                                           publish=publish).start()}
        self.client = LocalWorkerClient(self.decode, self.prefill)

    def prefill_hit_tokens(self) -> int:
        return sum(s.loop.call(lambda e: e.stats().prefix_hit_tokens_total).result(timeout=30)
                   for s in self.prefill.values())

    def close(self) -> None:
        for s in [*self.decode.values(), *self.prefill.values()]:
            s.close()


async def stream_ttft(client: httpx.AsyncClient, url: str, prompt: list[int]) -> float:
    body = {"model": "tandem", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and ttft is None and json.loads(line[6:])["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


async def drive(urls: list[str], prompts: list[list[int]], concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int, prompt: list[int]) -> float:
            async with sem:
                return await stream_ttft(client, urls[i % len(urls)], prompt)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def run_prefix(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.load(open_model(None).source)
    labels = (("round_robin", "round_robin", 1), ("prefix_aware", "prefix_aware", 1),
              ("prefix_aware x2 routers", "prefix_aware", 2))
    hit_rates: dict[str, list[float]] = {label: [] for label, _, _ in labels}
    p50s: dict[str, list[float]] = {label: [] for label, _, _ in labels}
    prefill_blocks = 5 * (SYSTEM_TOKENS + 64) // BS + 16  # ~5 of the 8 system prompts
    with EmbeddedRedis() as redis_url:
        for trial in range(args.trials):
            rng = random.Random(trial)
            systems = [[rng.randrange(3, 49152) for _ in range(SYSTEM_TOKENS)] for _ in range(NUM_SYSTEMS)]
            prompts = [systems[s] + [rng.randrange(3, 49152) for _ in range(rng.randrange(16, 64))]
                       for s in range(NUM_SYSTEMS) for _ in range(args.suffixes)]
            rng.shuffle(prompts)
            ideal = (len(prompts) - NUM_SYSTEMS) * (SYSTEM_TOKENS // BS) * BS
            print(f"trial {trial}: {len(prompts)} requests over {NUM_SYSTEMS} system prompts of {SYSTEM_TOKENS} "
                  f"tokens; {args.concurrency} in flight; prefill KV pools of {prefill_blocks} blocks; "
                  f"ideal hits {ideal} tokens")
            for label, policy, num_routers in labels:
                cluster = Cluster(redis_url, tokenizer, prefill_blocks)
                routers = [serve_router(RouterConfig(redis_url, cluster.name,
                                                     policy=remote_prefill_only(policy)),
                                        cluster.client, tokenizer, min_workers=3) for _ in range(num_routers)]
                try:
                    before = cluster.prefill_hit_tokens()
                    t0 = time.perf_counter()
                    ttfts = asyncio.run(drive([r.url for r in routers], prompts, args.concurrency))
                    elapsed = time.perf_counter() - t0
                    hits = cluster.prefill_hit_tokens() - before
                finally:
                    for r in routers:
                        r.stop()
                    cluster.close()
                hit_rates[label].append(hits / ideal)
                p50s[label].append(statistics.median(ttfts) * 1000)
                print(f"  {label:26s} hit tokens {hits:7d} = {hits / ideal:6.1%} of ideal   TTFT p50 "
                      f"{p50s[label][-1]:7.1f} ms   p90 {statistics.quantiles(ttfts, n=10)[-1] * 1000:7.1f} ms   "
                      f"wall {elapsed:5.1f} s")
    hit = {label: statistics.median(v) for label, v in hit_rates.items()}
    p50 = {label: statistics.median(v) for label, v in p50s.items()}
    one, two = hit["prefix_aware"], hit["prefix_aware x2 routers"]
    print(f"medians over {args.trials} trials: prefix_aware {one:.1%} of ideal hits (target >= 90%); TTFT p50 "
          f"{p50['prefix_aware']:.0f} ms vs round_robin {p50['round_robin']:.0f} ms = "
          f"{p50['round_robin'] / p50['prefix_aware']:.2f}x better (target >= 2x); two routers {two:.1%} vs one "
          f"{one:.1%} ({abs(two - one) * 100:.1f} points, target <= 3)")


_CLIENT = """
import asyncio, json, random, sys
import httpx
sys.path.insert(0, sys.argv[1])
from tests.bench.bench_router import stream_ttft
from tests.bench.lean_http import LeanSSEClient
router_url, noop_url = sys.argv[2], sys.argv[3]
rng = random.Random(2)
def body(n):
    return {"model": "tandem", "prompt": [rng.randrange(3, 49152) for _ in range(n)], "max_tokens": 4,
            "temperature": 0, "stream": True}
async def main():
    lean_router, lean_noop = LeanSSEClient(router_url), LeanSSEClient(noop_url)
    async with httpx.AsyncClient(timeout=60) as client:
        while sys.stdin.readline():  # one line per round, so rounds interleave with the direct calls
            times = {"router": lean_router.completion_ttft(body(32)), "noop": lean_noop.completion_ttft(body(3)),
                     "router, httpx client": await stream_ttft(client, router_url, body(32)["prompt"])}
            print(json.dumps(times), flush=True)
asyncio.run(main())
"""


def noop_sse_server() -> AppServer:
    """The HTTP + SSE stack alone: an endpoint that answers one event at once (same framework, same server)."""
    from fastapi import FastAPI

    from router.sse import EventStreamResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def noop(body: dict[str, Any]) -> EventStreamResponse:
        async def events() -> AsyncIterator[str]:
            yield 'data: {"choices": [{"text": "x"}]}\n\n'
            yield "data: [DONE]\n\n"

        return EventStreamResponse(events())

    return serve_app(app)


def tiny_model_dir(tokenizer: Tokenizer, path: Path) -> str:
    """A random-weight 2-layer Llama as an HF directory (a fast step, so the router's share shows)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return str(path)


def run_overhead(args: argparse.Namespace) -> None:
    import tempfile

    import ray

    from router.worker_client import RayWorkerClient
    from workers.actors import start_decode_worker, stream_generate
    from workers.resources import WorkerResources

    tokenizer = Tokenizer.load(open_model(None).source)
    rng = random.Random(1)
    # As deployed (``tandem serve``): the decode worker is a Ray actor in its own process, the router
    # (in this process) reaches it through Ray. The direct path calls the same actor the same way.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with EmbeddedRedis() as redis_url, tempfile.TemporaryDirectory() as model_dir:
        name = f"bench-{uuid.uuid4().hex[:6]}"
        config = EngineConfig(model=tiny_model_dir(tokenizer, Path(model_dir)), num_kv_blocks=512, block_size=BS)
        decode = start_decode_worker("d0", config, WorkerResources(num_cpus=1, torch_threads=1),
                                     publish=PublishConfig(redis_url, name))
        ray.get(decode.ready.remote())
        router = serve_router(RouterConfig(redis_url, name, policy=PolicyConfig(local_prefill_max_tokens=64)),
                              RayWorkerClient(ray.get_runtime_context().namespace), tokenizer)
        noop = noop_sse_server()
        # As through the router (``stream_ttft``): 4 tokens, timed to the first chunk with text (a
        # random model's first token may be a partial UTF-8 character that shows no text yet).
        params = SamplingParams(max_tokens=4, temperature=0.0)

        async def direct() -> float:
            prompt = [rng.randrange(3, 49152) for _ in range(32)]  # short: local prefill, no transfer
            t0 = time.perf_counter()
            ttft = None
            async for chunk in stream_generate(decode, GenerateRequest(uuid.uuid4().hex, prompt, params)):
                if ttft is None and chunk.text:
                    ttft = time.perf_counter() - t0
            return ttft if ttft is not None else time.perf_counter() - t0

        # The HTTP client in its own process, as real clients are (no GIL shared with the router); one
        # direct call, then the calls over HTTP, round after round. The lean client (tests/bench/lean_http)
        # costs what a C client would; httpx's own ~2 ms per request is shown beside it, not hidden.
        root = str(Path(__file__).resolve().parents[2])
        child = subprocess.Popen([sys.executable, "-c", _CLIENT, root, router.url, noop.url],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        direct_calls: list[float] = []
        measured: dict[str, list[float]] = {}
        loop = asyncio.new_event_loop()  # one loop for every direct call, as the router has its one
        try:
            for _ in range(args.repeats):
                direct_calls.append(loop.run_until_complete(direct()))
                child.stdin.write("go\n")
                child.stdin.flush()
                for key, seconds in json.loads(child.stdout.readline()).items():
                    measured.setdefault(key, []).append(seconds)
        finally:
            child.stdin.close()
            child.wait(timeout=30)
            loop.close()
            router.stop()
            noop.stop()
            ray.shutdown()
    def added_ms(name: str) -> float:  # the median of per-round differences: rounds share the noise
        return statistics.median(r - d for r, d in zip(measured[name], direct_calls, strict=True)) * 1000

    print(f"TTFT of a 32-token prompt, {args.repeats} rounds: direct call {statistics.median(direct_calls) * 1e3:.2f} "
          f"ms, via router {statistics.median(measured['router']) * 1e3:.2f} ms: the router adds "
          f"{added_ms('router'):.2f} ms (target <= 2 ms). Beside it: the HTTP + SSE round trip alone (a no-op "
          f"endpoint on the same stack) {statistics.median(measured['noop']) * 1e3:.2f} ms; through the router with "
          f"an httpx client instead of the lean one, the router adds {added_ms('router, httpx client'):.2f} ms")

    index = PrefixIndex()
    tokens = [rng.randrange(49152) for _ in range(8192)]
    hashes = hash_prompt_blocks(tokens, BS)
    for w in range(16):  # every worker holds a different share of the prompt
        index.apply_stored(f"w{w}", hashes[: len(hashes) * (w + 1) // 16], None)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        index.match(hashes)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    hash_prompt_blocks(tokens, BS)
    hash_us = (time.perf_counter() - t0) * 1e6
    print(f"match on an 8K-token prompt ({len(hashes)} blocks), 16 workers: median "
          f"{statistics.median(times) * 1e6:.0f} us (target <= 200 us); hashing its blocks {hash_us:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("prefix")
    p.add_argument("--suffixes", type=int, default=12, help="requests per system prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--trials", type=int, default=3, help="independent runs; medians are reported")
    o = sub.add_parser("overhead")
    o.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    run_prefix(args) if args.mode == "prefix" else run_overhead(args)


if __name__ == "__main__":
    main()
