"""The router's background tasks stop when told, even where a cancel is lost on the way (router/task_stop.py):
on Python 3.11 redis-py 8's writes swallow a cancel that lands as they finish, and a shutdown that waited for one
cancel hung."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from router.task_stop import cancel_and_wait
from router.worker_directory import WorkerDirectory
from workers.protocol.cluster_keys import ClusterKeys


def test_a_directory_polling_redis_stops_whenever_its_stop_lands(redis_url):
    async def scenario() -> None:
        # The router's own client settings (router/app.py), so redis-py's default socket timeout applies.
        client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2.0)
        rng = random.Random(5)
        for _ in range(100):
            directory = WorkerDirectory(client, ClusterKeys("task-stop"), poll_interval_s=0.0)  # always mid-poll
            await directory.start()
            await asyncio.sleep(rng.random() * 0.003)
            async with asyncio.timeout(5):
                await directory.stop()
        await client.aclose()

    asyncio.run(scenario())


def test_cancel_and_wait_cancels_again_a_task_that_ran_on_and_retrieves_errors():
    async def scenario() -> None:
        lives = [2]

        async def stubborn() -> None:  # swallows its first two cancels, as a lost cancel looks to its canceller
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    lives[0] -= 1
                    if lives[0] < 0:
                        raise

        async def failing() -> None:
            raise ValueError("ended badly")

        tasks = [asyncio.create_task(stubborn()), asyncio.create_task(failing()), asyncio.create_task(asyncio.sleep(0))]
        await asyncio.sleep(0.01)
        async with asyncio.timeout(5):
            await cancel_and_wait(tasks)
        assert lives == [-1] and tasks[0].cancelled()
        assert isinstance(tasks[1].exception(), ValueError) and tasks[2].result() is None

    asyncio.run(scenario())
