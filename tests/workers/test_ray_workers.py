"""Acceptance on local Ray (CPU, default model): prefill and decode actors with KV moved between them.

Clusters: tcp 1P+2D (outputs, local prefill, 32 concurrent, cancel, dead/stopped decode worker), and
nixl and nccl (gloo on CPU) 1P+1D (outputs). Every output is compared with a single engine's greedy
output in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernels.host_math import cdiv
from tests.prompts import reference_prompts, text_of_tokens
from workers.engine.config import EngineConfig
from workers.protocol.messages import (
    GenerateRequest,
    PrefillRequest,
    TokenChunk,
    WorkerLoad,
    pack,
    unpack,
)
from workers.protocol.sampling_params import SamplingParams
from workers.resources import WorkerResources
from workers.service.publisher import PublishConfig
from workers.transport.nixl import nixl_available

ray = pytest.importorskip("ray")
from workers.actors import start_decode_worker, start_prefill_worker, stream_generate  # noqa: E402

pytestmark = pytest.mark.slow
NAMESPACE = "tandem-test"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
KV_BYTES = 256 << 20  # ~5.8K tokens per worker
# Outputs are compared token for token with one engine: on the dense model, whose results do not depend on
# how many tokens share a step (the quantized path's kernel and BLAS paths round differently; see
# kernels/quant_linear.py).
WEIGHTS = "dense"
RESOURCES = WorkerResources(num_cpus=1, torch_threads=2)  # 2 cores here; one request at a time


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


def start_cluster(transport: str, num_decode: int, tag: str,
                  publish: PublishConfig | None = None) -> tuple[object, list[object]]:
    config = EngineConfig(kv_cache_bytes=KV_BYTES, weight_format=WEIGHTS)
    prefill = start_prefill_worker(f"{tag}-p0", config, RESOURCES, transport, NAMESPACE, publish)
    decodes = [start_decode_worker(f"{tag}-d{i}", config, RESOURCES, transport, NAMESPACE, transfer_timeout_s=5.0,
                                   publish=publish)
               for i in range(num_decode)]
    ray.get([w.ready.remote() for w in [prefill, *decodes]], timeout=300)
    return prefill, decodes


@pytest.fixture(scope="module")
def tcp_cluster(ray_cluster, redis_url):
    """Published to Redis under the cluster name ``ray-tcp`` (the router test reads it from there)."""
    prefill, decodes = start_cluster("tcp", 2, "tcp", PublishConfig(redis_url, "ray-tcp"))
    yield prefill, decodes
    for w in [prefill, *decodes]:
        ray.kill(w)


@pytest.fixture(scope="module")
def expected(make_engine):
    """Prompts (token ids) and the single engine's greedy outputs."""
    engine = make_engine(dense=True)
    prompts = [engine.tokenize(p) for p in reference_prompts(engine.tokenizer)]
    assert min(map(len, prompts)) <= 10 and max(map(len, prompts)) >= 1400
    return prompts, [r.token_ids for r in engine.generate(prompts, GREEDY)]


def generate(decode, rid: str, prompt_ids: list[int], prefill_worker: str | None,
             params: SamplingParams = GREEDY) -> list[TokenChunk]:
    async def run() -> list[TokenChunk]:
        req = GenerateRequest(rid, prompt_ids, params, None, prefill_worker)
        return [c async for c in stream_generate(decode, req)]

    return asyncio.run(run())


def used_blocks(*workers) -> list[int]:
    return ray.get([w.num_used_blocks.remote() for w in workers])


def check_outputs(decode, prefill_worker: str | None, expected, tag: str) -> None:
    prompts, outputs = expected
    for i, (prompt, want) in enumerate(zip(prompts, outputs, strict=True)):
        chunks = generate(decode, f"{tag}-{i}", prompt, prefill_worker)
        assert chunks[-1].error is None, chunks[-1].error
        assert [t for c in chunks for t in c.token_ids] == want, f"prompt {i} ({len(prompt)} tokens)"


def test_tcp_outputs_equal_single_engine(tcp_cluster, expected):
    prefill, (d0, _) = tcp_cluster
    check_outputs(d0, "tcp-p0", expected, "tcp")
    load = unpack(WorkerLoad, ray.get(prefill.load.remote()))
    assert load.role == "prefill"
    metrics = ray.get(prefill.metrics.remote()).decode()
    assert "tandem_kv_transfer_bytes_total" in metrics and "tandem_prefill_tokens_total" in metrics


def test_each_worker_runs_torch_on_its_engine_thread_alone(tcp_cluster):
    """A second OpenMP team in a worker process (its main thread loading the model on num_cpus threads) makes
    libgomp sleep between parallel regions, and a decode step took 4x as long (bench_served_step.py): every
    thread of a worker but the engine's runs torch on one thread."""
    prefill, decodes = tcp_cluster
    for worker in [prefill, *decodes]:
        info = ray.get(worker.ready.remote())
        assert info["engine_threads"] == RESOURCES.engine_threads == 2
        env = Path(f"/proc/{info['pid']}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in env


def test_local_prefill_outputs_equal_single_engine(tcp_cluster, expected):
    _, (_, d1) = tcp_cluster
    check_outputs(d1, None, expected, "local")


def test_a_prefill_worker_that_is_gone_is_a_transfer_error_and_frees_the_reserved_blocks(tcp_cluster, expected):
    """The kind the router retries as a local prefill (a drained prefill worker's actor is gone)."""
    _, (d0, _) = tcp_cluster
    prompts, _ = expected
    chunks = generate(d0, "gone-0", prompts[-1], "tcp-p-drained")
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].error_kind == "transfer"
    assert chunks[0].error == "prefill worker 'tcp-p-drained' is gone"
    wait_until(lambda: used_blocks(d0) == [0])


@pytest.mark.parametrize("transport", [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 missing")),
    "nccl",  # torch.distributed send/recv; gloo between these CPU caches
])
def test_other_transports_outputs_equal_single_engine(ray_cluster, expected, transport):
    if transport == "nccl":  # not one of the CPU backends: the shortest and longest prompts suffice
        prompts, outputs = expected
        ends = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[:: len(prompts) - 1]
        expected = [prompts[i] for i in ends], [outputs[i] for i in ends]
    prefill, (d0,) = start_cluster(transport, 1, transport)
    try:
        check_outputs(d0, f"{transport}-p0", expected, transport)
        assert used_blocks(prefill, d0) == [0, 0]
    finally:
        for w in (prefill, d0):
            ray.kill(w)


def test_32_concurrent_requests_over_1p2d_leave_no_block_held(tcp_cluster, make_engine):
    prefill, decodes = tcp_cluster
    tokenizer = make_engine().tokenizer
    prompts = [tokenizer.encode(text_of_tokens(tokenizer, 20 + 7 * i, seed=i)) for i in range(32)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1)

    async def run() -> list[list[TokenChunk]]:
        async def one(i: int) -> list[TokenChunk]:
            req = GenerateRequest(f"c32-{i}", prompts[i], params, None, "tcp-p0")
            return [c async for c in stream_generate(decodes[i % 2], req)]
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    assert all(r[-1].finished and r[-1].error is None and r[-1].num_output_tokens == 12 for r in results)
    assert used_blocks(prefill, *decodes) == [0, 0, 0]


def test_cancel_while_decoding_and_while_prefilling(tcp_cluster, make_engine):
    prefill, (d0, _) = tcp_cluster
    tokenizer = make_engine().tokenizer
    long_prompt = tokenizer.encode(text_of_tokens(tokenizer, 1500, seed=11))

    async def cancel_after(num_chunks: int, prompt: list[int], rid: str, wait_for_prefill: bool) -> None:
        req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=500, ignore_eos=True),
                              None, "tcp-p0")
        stream = stream_generate(d0, req)
        if wait_for_prefill:
            task = asyncio.ensure_future(anext(stream))
            while unpack(WorkerLoad, await prefill.load.remote()).num_running == 0:
                await asyncio.sleep(0.02)
            task.cancel()  # the stream's own cleanup cancels the Ray task
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:
            for _ in range(num_chunks):
                await anext(stream)
        await stream.aclose()

    # An ignored cancel would run the request to its 500 tokens (freeing the blocks only then), so the
    # decode worker's steps are counted too: a machine fast enough to finish within the wait still fails.
    steps_before = sample_value(d0, "tandem_step_seconds_count", phase="decode")
    asyncio.run(cancel_after(3, long_prompt[:50], "cancel-decode", wait_for_prefill=False))
    wait_until(lambda: used_blocks(d0) == [0])
    assert sample_value(d0, "tandem_step_seconds_count", phase="decode") - steps_before < 100
    # A cancelled prefill sends no KV: the prefill worker's transfer bytes stay where they were.
    sent_before = sample_value(prefill, "tandem_kv_transfer_bytes_total")
    asyncio.run(cancel_after(0, long_prompt, "cancel-prefill", wait_for_prefill=True))
    wait_until(lambda: used_blocks(prefill, d0) == [0, 0])
    assert sample_value(prefill, "tandem_kv_transfer_bytes_total") == sent_before


def sample_value(worker, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    """One sample of a worker actor's Prometheus exposition (0 if it has none yet)."""
    text = ray.get(worker.metrics.remote(), timeout=30).decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_until(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


@pytest.mark.parametrize("failure", ["killed", "stopped"])
def test_transfer_to_a_dead_or_silent_decode_worker_fails_in_time(tcp_cluster, make_engine, failure):
    prefill, (d0, _) = tcp_cluster
    victim = start_decode_worker(f"victim-{failure}", EngineConfig(kv_cache_bytes=KV_BYTES, weight_format=WEIGHTS),
                                 RESOURCES, "tcp", NAMESPACE)
    info = ray.get(victim.ready.remote(), timeout=300)
    if failure == "killed":
        ray.kill(victim)
        time.sleep(1)
    else:
        os.kill(info["pid"], signal.SIGSTOP)
    tokenizer = make_engine().tokenizer
    prompt = tokenizer.encode(text_of_tokens(tokenizer, 200, seed=3))
    nblocks = cdiv(len(prompt), 16)
    request = PrefillRequest("to-victim", prompt, GREEDY, None, info["kv_address"],
                             list(range(nblocks)), 0, timeout_s=3.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception, match="transfer to-victim .*(failed|timed out)"):
            ray.get(prefill.prefill.remote(pack(request)), timeout=30)
        assert time.monotonic() - t0 < 3.0 + 10  # the timeout, plus the prefill itself on this CPU
    finally:
        if failure == "stopped":
            os.kill(info["pid"], signal.SIGCONT)
            ray.kill(victim)
    chunks = generate(d0, "after-victim", prompt, "tcp-p0")  # the prefill worker keeps serving
    assert chunks[-1].error is None and chunks[-1].num_output_tokens == GREEDY.max_tokens
    wait_until(lambda: used_blocks(prefill) == [0])


def test_a_routers_requests_share_one_output_stream_a_decode_worker(tcp_cluster, make_engine):
    """RayWorkerClient (what routers use): a decode worker's chunks for this router come on one Ray stream, a
    batch a step, not an item a token. Outputs equal the single engine's; closing a request's stream early
    cancels it on the worker; a worker that leaves the registry (a drain) streams its requests to their end, and
    then this router's channel there closes."""
    from router.worker_client import RayWorkerClient

    _, (d0, _) = tcp_cluster
    # Prompts of their own (prefilled on d0: the reference prompts' blocks there would change how the router test
    # below routes), against one engine's greedy output.
    engine = make_engine(dense=True)
    prompts = [engine.tokenize(text_of_tokens(engine.tokenizer, n, seed=200 + n)) for n in (5, 60, 300, 900)]
    outputs = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    long_prompt = engine.tokenize(text_of_tokens(engine.tokenizer, 60, seed=250))
    endless = SamplingParams(max_tokens=500, ignore_eos=True)
    client = RayWorkerClient(NAMESPACE)

    async def collect(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[TokenChunk]:
        return [c async for c in client.generate("tcp-d0", GenerateRequest(rid, prompt, params))]

    async def run() -> tuple[list[list[TokenChunk]], int, int]:
        results = await asyncio.gather(*(collect(f"mux-{i}", p) for i, p in enumerate(prompts)))
        batches = client._outputs["tcp-d0"].num_batches
        steps_before = sample_value(d0, "tandem_step_seconds_count", phase="decode")
        stream = client.generate("tcp-d0", GenerateRequest("mux-closed", long_prompt, endless))
        for _ in range(3):
            await anext(stream)
        await stream.aclose()
        await asyncio.to_thread(wait_until, lambda: used_blocks(d0) == [0])
        steps = sample_value(d0, "tandem_step_seconds_count", phase="decode") - steps_before
        channel = client._outputs["tcp-d0"]
        stream = client.generate("tcp-d0", GenerateRequest("mux-drained", long_prompt, SamplingParams(
            max_tokens=60, ignore_eos=True)))
        drained = [await anext(stream)]
        client.forget(["tcp-d0"])  # as the router's directory does when the worker leaves routing
        drained += [c async for c in stream]
        assert drained[-1].finished and drained[-1].error is None and drained[-1].num_output_tokens == 60
        assert channel.error is not None  # then closed: the worker's channel for this router is gone
        await asyncio.to_thread(wait_until, lambda: not ray.get(d0.renew_channel.remote(channel.channel_id)))
        return results, batches, steps

    results, batches, steps = asyncio.run(run())
    for i, (chunks, want) in enumerate(zip(results, outputs, strict=True)):
        assert chunks[-1].error is None, chunks[-1].error
        assert [t for c in chunks for t in c.token_ids] == want, f"prompt {i}"
    tokens = sum(len(c.token_ids) for chunks in results for c in chunks)
    assert batches < tokens / 2, (batches, tokens)
    assert steps < 100  # cancelled, not run to its 500 tokens


def test_a_request_on_an_output_stream_the_worker_has_closed_is_unreachable_and_the_next_resubscribes(
        tcp_cluster, make_engine):
    """The worker closed this router's channel (unrenewed for its TTL: a stalled router) before the router heard:
    the next request's start is refused there, and its stream ends as WorkerUnreachable (the router's failover
    re-routes it), not a hang or an unexpected Ray error; the request after it subscribes afresh and streams, and
    the spent subscription is closed on the worker."""
    from router.worker_client import RayWorkerClient, WorkerUnreachable

    _, (d0, _) = tcp_cluster
    engine = make_engine(dense=True)
    prompt = engine.tokenize(text_of_tokens(engine.tokenizer, 40, seed=260))
    want = engine.generate([prompt], GREEDY)[0].token_ids
    client = RayWorkerClient(NAMESPACE)

    async def collect(rid: str) -> list[TokenChunk]:
        return [c async for c in client.generate("tcp-d0", GenerateRequest(rid, prompt, GREEDY))]

    async def run() -> tuple[list[TokenChunk], str]:
        await collect("stale-0")
        stale = client._outputs["tcp-d0"]
        subscribed_id = stale.channel_id
        stale.channel_id = "closed-on-the-worker"  # what the router holds names no channel there any more
        with pytest.raises(WorkerUnreachable, match="closed its output stream"):
            await collect("stale-1")
        assert stale.error is not None
        chunks = await collect("stale-2")
        assert client._outputs["tcp-d0"] is not stale
        return chunks, subscribed_id

    chunks, subscribed_id = asyncio.run(run())
    assert chunks[-1].error is None and [t for c in chunks for t in c.token_ids] == want
    wait_until(lambda: not ray.get(d0.renew_channel.remote(subscribed_id)))
    wait_until(lambda: used_blocks(d0) == [0])


def test_router_over_ray_workers_with_the_openai_client(tcp_cluster, redis_url, make_engine):
    """The whole path: openai client -> router (HTTP) -> decode actor -> prefill actor, found through Redis."""
    import httpx
    import openai

    from router.policy import PolicyConfig
    from router.state import RouterConfig
    from router.worker_client import RayWorkerClient
    from tests.router.serve import serve_router

    engine = make_engine(dense=True)
    config = RouterConfig(redis_url, "ray-tcp", served_model_name="smol",
                          policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
    router = serve_router(config, RayWorkerClient(NAMESPACE), engine.tokenizer, min_workers=3)
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
        # A question of its own: the reference prompts' are cached on the decode workers, and the router would
        # prefill one there (the worker caching it keeps it), never crossing from the prefill worker.
        messages = [{"role": "user", "content": "Name three rivers of South America and where they flow."}]
        want = engine.generate([{"messages": messages}], SamplingParams(max_tokens=16, temperature=0.0))[0].text
        reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == want
        events = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0,
                                                stream=True)
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == want
        metrics = httpx.get(f"{router.url}/metrics", timeout=30).text
        for worker in ("tcp-p0", "tcp-d0", "tcp-d1"):
            assert f'worker_id="{worker}"' in metrics
        routes = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("tandem_router_routes_total")}
        assert routes.get('tandem_router_routes_total{prefill="remote"}', 0) >= 1, routes
        assert sum(routes.values()) == 2, routes
    finally:
        router.stop()


def test_streams_survive_a_decode_worker_killed_with_sigkill(tcp_cluster, redis_url, make_engine):
    """Issue 22's acceptance: 4 greedy streams on one decode worker (tcp-d1), which gets SIGKILL once each has
    sent 8 tokens; all 4 finish on tcp-d0 without an error event, with an undisturbed run's text."""
    import threading

    import httpx

    from router.policy import PolicyConfig
    from router.state import RouterConfig
    from router.worker_client import RayWorkerClient
    from tests.router.serve import serve_router
    from tests.router.test_failover import MAX_TOKENS, QUESTIONS, stream_chat

    _, (_, victim) = tcp_cluster  # the module's last test: tcp-d1 dies here
    pid = ray.get(victim.ready.remote(), timeout=60)["pid"]
    engine = make_engine(dense=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    want = [engine.generate([{"messages": [{"role": "user", "content": q}]}], greedy)[0].text for q in QUESTIONS]
    config = RouterConfig(redis_url, "ray-tcp", served_model_name="tandem-test",
                          policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
    router = serve_router(config, RayWorkerClient(NAMESPACE), engine.tokenizer, min_workers=3)
    directory = router.app.state.router.directory
    live, others = directory.live, {"tcp-d0"}
    directory.live = lambda role: [e for e in live(role) if e.info.worker_id not in others]  # all on the victim
    try:
        progress = [[0] for _ in QUESTIONS]
        outs: list[dict] = [{} for _ in QUESTIONS]  # type: ignore[type-arg]
        threads = [threading.Thread(target=stream_chat, args=(router.url, q, {"temperature": 0}, progress[i],
                                                              outs[i])) for i, q in enumerate(QUESTIONS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(p[0] for p in progress) < 8:
            assert time.monotonic() < deadline and all(t.is_alive() for t in threads), progress
            time.sleep(0.01)
        others.clear()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert [o["errors"] for o in outs] == [[]] * 4 and [o["status"] for o in outs] == [200] * 4
        assert [o["text"] for o in outs] == want
        metrics = httpx.get(f"{router.url}/metrics", timeout=30).text
        assert 'tandem_router_failovers_total{reason="unreachable"} 4.0' in metrics
    finally:
        directory.live = live
        router.stop()
