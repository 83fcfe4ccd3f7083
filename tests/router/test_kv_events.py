"""Workers publish KV events and load to a real Redis; routers' indexes follow them exactly."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from router.kv_event_consumer import KVEventConsumer
from router.prefix_index import PrefixIndex
from router.worker_directory import WorkerDirectory
from tests.prompts import text_of_tokens
from workers.protocol.cluster_keys import ClusterKeys, WorkerInfo
from workers.protocol.messages import GenerateRequest, WorkerLoad, pack
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.publisher import PublishConfig
from workers.transport.tcp import TcpTransport


@pytest.fixture
def keys():
    return ClusterKeys(f"test-{uuid.uuid4().hex[:8]}")


def cached_hashes(service: DecodeService) -> set[int]:
    return service.loop.call(lambda e: {h for h, _ in e.block_pool.cached_chains()}).result(timeout=10)


async def run_prompts(service: DecodeService, prompts: list[list[int]], tag: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def one(i: int, ids: list[int]) -> None:
        async for chunk in service.generate(GenerateRequest(f"{tag}-{i}", ids, params)):
            assert chunk.error is None

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def converge(consumer: KVEventConsumer, worker_id: str, want: set[int], timeout_s: float = 10.0) -> set[int]:
    directory = WorkerDirectory(consumer.redis, consumer.keys)
    deadline = time.monotonic() + timeout_s
    while True:
        await directory.poll()
        worker = directory.workers.get(worker_id)  # None until its first heartbeat lands (slow machines)
        if worker is not None:
            await consumer.sync({worker_id: (worker.load.kv_events_epoch, worker.load.kv_events_seq)})
        got = consumer.index.blocks_of(worker_id)
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


def test_indexes_follow_events_snapshots_and_gaps(make_engine, redis_url, keys):
    engine = make_engine(num_kv_blocks=48, block_size=16)
    tok = engine.tokenizer
    service = DecodeService(engine, TcpTransport(), "d0", None, publish=PublishConfig(redis_url, keys.cluster)).start()
    system = tok.encode(text_of_tokens(tok, 100, seed=1))
    prompts = [system + tok.encode(text_of_tokens(tok, 20 + 7 * i, seed=10 + i)) for i in range(6)]
    prompts += [tok.encode(text_of_tokens(tok, 150, seed=50 + i)) for i in range(4)]  # overflow: evictions

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        early = KVEventConsumer(client, keys, PrefixIndex())
        await converge(early, "d0", set())
        await run_prompts(service, prompts[:6], "a")
        want = cached_hashes(service)
        assert want and await converge(early, "d0", want) == want
        await run_prompts(service, prompts[6:], "b")
        want = cached_hashes(service)
        assert await converge(early, "d0", want) == want
        # A router that starts late converges through the snapshot plus the stream's tail.
        late = KVEventConsumer(client, keys, PrefixIndex())
        assert await converge(late, "d0", want) == want
        # Entries lost before a reader saw them (the stream trimmed): the gap triggers a snapshot reload.
        await run_prompts(service, prompts[:3], "c")
        await asyncio.sleep(0.5)  # published, unread
        await client.xtrim(keys.kv_stream("d0"), maxlen=0)
        await run_prompts(service, prompts[6:8], "d")
        want = cached_hashes(service)
        assert await converge(early, "d0", want, timeout_s=15.0) == want
        assert early.num_resyncs >= 1
        assert late.index.check_integrity() and early.index.check_integrity()
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        service.close()


def test_directory_sees_workers_come_and_go(make_engine, redis_url, keys):
    service = DecodeService(make_engine(), TcpTransport(), "d1", None,
                            publish=PublishConfig(redis_url, keys.cluster)).start()

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        directory = WorkerDirectory(client, keys)
        removed: list[str] = []
        directory.on_removed.append(removed.extend)
        deadline = time.monotonic() + 10
        while "d1" not in directory.workers and time.monotonic() < deadline:
            await directory.poll()
            await asyncio.sleep(0.05)
        entry = directory.workers["d1"]
        assert entry.info.role == "decode" and entry.load.kv_blocks_total == 1024
        service.close()  # leaves the registry at once
        await directory.poll()
        assert "d1" not in directory.workers and removed == ["d1"]
        await client.aclose()

    asyncio.run(scenario())


def test_directory_keeps_its_view_while_workers_return_after_redis_lost_its_data(redis_url, keys):
    """A Redis flushed (or restarted empty) looks like every worker leaving at once; the directory sees its
    own mark gone and keeps routing to the workers it knew while they register again, for a grace period."""
    client = redis.Redis.from_url(redis_url)

    def register(worker: str) -> None:
        client.hset(keys.registry, worker, msgpack.packb(asdict(WorkerInfo(worker, "decode", None, 16, 100, 512))))
        client.set(keys.load(worker), pack(WorkerLoad(worker, "decode", 0, 0, 0, 100, 0, 0)), px=60_000)

    def lose_the_data() -> None:
        client.delete(*client.scan_iter(f"tandem:{keys.cluster}:*"))

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        directory = WorkerDirectory(aclient, keys, data_loss_grace_s=0.5)
        register("a")
        register("b")
        await directory.poll()
        assert set(directory.workers) == {"a", "b"}
        lose_the_data()
        await directory.poll()
        assert set(directory.workers) == {"a", "b"}  # kept, not "everyone left"
        register("a")  # a returns; b never does
        await directory.poll()
        assert set(directory.workers) == {"a", "b"}
        await asyncio.sleep(0.6)
        await directory.poll()
        assert set(directory.workers) == {"a"}  # the grace is over: b is gone
        client.hdel(keys.registry, "a")  # an ordinary departure, Redis intact: at once
        await directory.poll()
        assert directory.workers == {}
        await directory.stop()
        await aclient.aclose()

    asyncio.run(scenario())


def test_silent_worker_leaves_when_its_heartbeat_expires(redis_url, keys):
    """A worker that dies without saying so: its load key's TTL runs out and it leaves routing."""
    client = redis.Redis.from_url(redis_url)
    client.hset(keys.registry, "ghost", msgpack.packb(asdict(WorkerInfo("ghost", "prefill", None, 16, 100, 512))))
    client.set(keys.load("ghost"), pack(WorkerLoad("ghost", "prefill", 0, 0, 0, 100, 0, 0)), px=300)

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        directory = WorkerDirectory(aclient, keys)
        await directory.poll()
        assert "ghost" in directory.workers
        await asyncio.sleep(0.5)
        await directory.poll()
        assert "ghost" not in directory.workers
        await aclient.aclose()

    asyncio.run(scenario())
