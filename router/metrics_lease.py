"""Which router exports the workers' series: the one holding a lease in Redis.

Prometheus scrapes every router; were each to re-export every worker's series, each worker would count once
per router. The holder renews the lease at each scrape; when it stops (it died, or left), another router
takes it over once the lease lapses, so the series keep coming from one router at a time.
"""

from __future__ import annotations

import contextlib

import redis.asyncio as aioredis

from workers.protocol.cluster_keys import ClusterKeys

# Longer than any sane scrape interval, so the holder keeps the lease between its scrapes.
LEASE_S = 60


async def holds_metrics_lease(redis: aioredis.Redis, keys: ClusterKeys, router_id: str) -> bool:
    """True if this router exports the workers' series now (taking or renewing the lease). Without Redis,
    True: a scrape that shows the workers twice beats one that hides them."""
    try:
        if await redis.set(keys.metrics_lease, router_id, nx=True, ex=LEASE_S):
            return True
        if await _holder(redis, keys) == router_id:
            await redis.expire(keys.metrics_lease, LEASE_S)
            return True
        return False
    except aioredis.RedisError:
        return True


async def release_metrics_lease(redis: aioredis.Redis, keys: ClusterKeys, router_id: str) -> None:
    """A router leaving hands the lease on at once (the next router scraped takes it)."""
    with contextlib.suppress(aioredis.RedisError):
        if await _holder(redis, keys) == router_id:
            await redis.delete(keys.metrics_lease)


async def _holder(redis: aioredis.Redis, keys: ClusterKeys) -> str | None:
    holder: bytes | None = await redis.get(keys.metrics_lease)  # type: ignore[assignment]
    return None if holder is None else holder.decode()
