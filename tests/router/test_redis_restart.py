"""Redis restarted under a running cluster (issue 22 item 3): requests keep being served while it is down,
the workers register again and republish their caches once it is back, and the router's prefix index (and a
router started afterwards) finds the cached blocks again within seconds."""

from __future__ import annotations

import time

import httpx

from cluster.embedded_redis import EmbeddedRedis
from router.policy import PolicyConfig
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient
from tests.router.conftest import MODEL, running_cluster
from tests.router.serve import serve_router
from workers.protocol.block_hash import hash_prompt_blocks

PROMPT = "The lighthouse keeper counted the waves as the storm came in over the black rocks. " * 4


def complete(url: str) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def cached_blocks(router, block_hashes: list[int]) -> int:  # type: ignore[no-untyped-def]
    return router.app.state.router.index.match(block_hashes).get("d0", 0)


def wait_for(condition, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, "not reached in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_serving_goes_on_through_a_redis_restart_and_the_index_rebuilds(make_engine) -> None:
    redis = EmbeddedRedis()
    port = redis.port
    with running_cluster(redis.url, lambda: make_engine(max_model_len=2048)) as (router, prefill, decode):
        tokenizer = decode.loop.engine.tokenizer
        block_hashes = hash_prompt_blocks(tokenizer.encode(PROMPT), 16, None)
        full_blocks = len(block_hashes)
        assert complete(router.url) == 200
        wait_for(lambda: cached_blocks(router, block_hashes) >= full_blocks, 10)

        redis.stop()
        assert complete(router.url) == 200  # served from the router's last view while Redis is down
        redis = EmbeddedRedis(port=port)  # back, empty: no registry, no streams, no snapshots
        try:
            assert complete(router.url) == 200  # whether or not the workers have registered again yet
            def ready() -> bool:
                body = httpx.get(f"{router.url}/ready", timeout=5).json()
                return bool(body["ready"]) and body["decode_workers"] + body["prefill_workers"] == 2

            wait_for(ready, 15)
            rebuilt_s = wait_for(lambda: cached_blocks(router, block_hashes) >= full_blocks, 10)
            assert complete(router.url) == 200
            # A router started now builds its index from the workers' republished snapshots.
            t0 = time.monotonic()
            config = RouterConfig(redis.url, router.app.state.router.config.cluster, served_model_name=MODEL,
                                  policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
            second = serve_router(config, LocalWorkerClient({"d0": decode}, {"p0": prefill}), tokenizer,
                                  min_workers=2)
            try:
                wait_for(lambda: cached_blocks(second, block_hashes) >= full_blocks, 5)
                print(f"index rebuilt {rebuilt_s:.2f} s after Redis was back; a new router's in "
                      f"{time.monotonic() - t0:.2f} s")
                assert complete(second.url) == 200
            finally:
                second.stop()
        finally:
            redis.stop()


def test_a_redis_that_lost_its_data_without_dropping_connections_is_refilled(make_engine) -> None:
    """FLUSHALL: what a restart too quick for any worker to notice looks like (redis-py reconnects
    silently). Each worker sees its registration gone at its next load report and starts over; requests
    sent meanwhile are served from the router's last view."""
    import redis as redis_py

    with EmbeddedRedis() as url, running_cluster(url, lambda: make_engine(max_model_len=2048)) as (router, _, dec):
        block_hashes = hash_prompt_blocks(dec.loop.engine.tokenizer.encode(PROMPT), 16, None)
        assert complete(router.url) == 200
        wait_for(lambda: cached_blocks(router, block_hashes) >= len(block_hashes), 10)
        directory = router.app.state.router.directory
        epochs = {w: e.load.kv_events_epoch for w, e in directory.workers.items()}
        redis_py.Redis.from_url(url).flushall()
        for _ in range(5):  # across the window in which the registry is empty
            assert complete(router.url) == 200

        def registered_again() -> bool:
            now = {w: e.load.kv_events_epoch for w, e in directory.workers.items()}
            return now.keys() == epochs.keys() and all(now[w] != epochs[w] for w in epochs)

        wait_for(registered_again, 10)  # each worker started a new epoch
        wait_for(lambda: cached_blocks(router, block_hashes) >= len(block_hashes), 10)
        assert complete(router.url) == 200
