"""Draining a worker (what a shrinking pool does): it leaves the Redis registry at once, still
serves requests already in flight and those routed during the grace period, then stops, leaving
none of its keys behind. Real services, real Redis, KV over tcp; no Ray."""

from __future__ import annotations

import asyncio
import threading
import uuid

import redis

from tests.prompts import text_of_tokens
from tests.workers.test_services import collect, request
from workers.protocol.cluster_keys import ClusterKeys
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.service.publisher import PublishConfig
from workers.transport.tcp import TcpTransport

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def worker_keys(r: redis.Redis, keys: ClusterKeys, worker: str) -> list[str]:
    names = [keys.load(worker), keys.kv_stream(worker), keys.kv_snapshot(worker)]
    return [n for n in names if r.exists(n)] + (["registry"] if r.hexists(keys.registry, worker) else [])


async def wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_drain_leaves_routing_first_finishes_in_flight_and_late_requests_then_stops(make_engine, redis_url):
    keys = ClusterKeys(f"drain-{uuid.uuid4().hex[:8]}")
    publish = PublishConfig(redis_url, keys.cluster)
    r = redis.Redis.from_url(redis_url)
    prefill = PrefillService(make_engine(), TcpTransport(), "p0", publish=publish).start()
    decode = DecodeService(make_engine(), TcpTransport(), "d0", LocalPrefillClient({"p0": prefill}),
                           transfer_timeout_s=5.0, publish=publish).start()
    single = make_engine()
    prompts = [text_of_tokens(single.tokenizer, n, seed=n) for n in (60, 90)]
    want = [out.token_ids for out in single.generate(prompts, LONG)]

    async def run():  # type: ignore[no-untyped-def]
        await wait_for(lambda: len(worker_keys(r, keys, "d0")) == 4)  # registered, load, stream, snapshot
        first = asyncio.create_task(collect(decode, request(single, "r0", prompts[0], LONG)))
        await wait_for(lambda: decode.num_in_flight() == 1 and decode.loop.engine.stats().num_running == 1)
        # Hold the engine thread between steps so the request cannot finish before we look (a fast
        # step used to end its 40 tokens before the registry check ran).
        held = threading.Event()
        decode.loop.call(lambda e: held.wait(10.0))
        drain = asyncio.create_task(decode.drain(grace_s=0.5))
        await wait_for(lambda: not r.hexists(keys.registry, "d0"))
        assert not first.done(), "the worker must leave routing before its in-flight request ends"
        held.set()
        # Routed by a router that had not yet seen d0 leave: still served, within the grace period.
        late = await collect(decode, request(single, "r1", prompts[1], LONG))
        return await first, late, await drain

    first, late, report = asyncio.run(run())
    for chunks, tokens in zip((first, late), want, strict=True):
        assert chunks[-1].finished and chunks[-1].error is None
        assert [t for c in chunks for t in c.token_ids] == tokens
    assert report.worker_id == "d0" and report.in_flight == 1 and report.arrived_after == 1
    assert report.unfinished == 0 and report.seconds >= 0.5
    assert worker_keys(r, keys, "d0") == []
    assert decode.loop.call(lambda e: 0).exception() is not None  # its engine loop has stopped
    idle = asyncio.run(prefill.drain(grace_s=0.0))
    assert idle.in_flight == 0 and idle.arrived_after == 0 and worker_keys(r, keys, "p0") == []
    decode.close()  # a second close (shutdown after a drain) is harmless
    prefill.close()


def test_drain_timeout_stops_the_worker_and_its_unfinished_request_ends_with_an_error(make_engine, redis_url):
    decode = DecodeService(make_engine(), TcpTransport(), "d1", None,
                           publish=PublishConfig(redis_url, f"drain-{uuid.uuid4().hex[:8]}")).start()
    single = make_engine()
    endless = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)

    async def run():  # type: ignore[no-untyped-def]
        stream = asyncio.create_task(collect(decode, request(single, "r0", "Tell me a story.", endless, None)))
        await wait_for(lambda: decode.num_in_flight() == 1)
        report = await decode.drain(grace_s=0.0, timeout_s=0.5)
        return report, await asyncio.wait_for(stream, 10)

    report, chunks = asyncio.run(run())
    assert report.in_flight == 1 and report.unfinished == 1 and 0.5 <= report.seconds < 5
    # Stopped with the worker: the stream ends with an error a router turns into 503, it does not hang.
    assert chunks[-1].finished and chunks[-1].error_kind == "unavailable" and "stopped" in chunks[-1].error
    late = asyncio.run(collect(decode, request(single, "r1", "Hello", endless, None)))
    assert len(late) == 1 and late[0].error_kind == "unavailable"


def test_a_stopped_prefill_worker_is_unavailable_and_the_decode_worker_frees_its_blocks(make_engine):
    """``unavailable`` before the first token: the router retries the request as a local prefill."""
    prefill = PrefillService(make_engine(), TcpTransport(), "p9").start()
    decode = DecodeService(make_engine(), TcpTransport(), "d9", LocalPrefillClient({"p9": prefill}),
                           transfer_timeout_s=5.0).start()
    prefill.close()
    single = make_engine()
    chunks = asyncio.run(collect(decode, request(single, "r0", text_of_tokens(single.tokenizer, 80, seed=3),
                                                 LONG, "p9")))
    assert len(chunks) == 1 and chunks[0].error_kind == "unavailable" and "p9 has stopped" in chunks[0].error
    assert decode.loop.call(lambda e: e.block_pool.num_used_blocks).result(timeout=10) == 0
    assert decode.num_in_flight() == 0
    decode.close()
