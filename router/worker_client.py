"""How a router reaches workers: a request's chunks from a decode worker, and each worker's metrics. Ray actor
handles in a cluster (each decode worker's chunks for this router on one stream: worker_outputs.py); services in
the same process for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping
from typing import Protocol

from router.worker_outputs import OutputStreamLost, WorkerOutputs
from workers.protocol.messages import GenerateRequest, TokenChunk
from workers.service.base import EngineService
from workers.service.decode import DecodeService
from workers.service.named_actors import NamedActors


class WorkerUnreachable(Exception):
    """The worker could not be reached at all (gone, or never there)."""


class WorkerClient(Protocol):
    def generate(self, decode_worker: str, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Closing the iterator early cancels the request on every worker it touched."""
        ...

    async def metrics(self, worker_id: str) -> bytes: ...

    def forget(self, worker_ids: list[str]) -> None:
        """These workers left the registry: drop what is kept about them."""
        ...


class RayWorkerClient:
    """Workers are named Ray actors (their worker id) in ``namespace``."""

    def __init__(self, namespace: str | None):
        self.namespace = namespace
        self._actors = NamedActors(namespace, lambda w: WorkerUnreachable(f"no worker actor {w!r}"))
        self._outputs: dict[str, WorkerOutputs] = {}

    def forget(self, worker_ids: list[str]) -> None:
        for worker_id in worker_ids:
            self._actors.forget(worker_id)
            outputs = self._outputs.pop(worker_id, None)
            if outputs is not None:  # a draining worker finishes the requests it has: they stream on till then
                outputs.retire()

    def _outputs_of(self, decode_worker: str) -> WorkerOutputs:
        outputs = self._outputs.get(decode_worker)
        # The first request there, its stream ended, or a caller on another event loop (tests): subscribe.
        if outputs is None or outputs.error is not None or outputs.loop is not asyncio.get_running_loop():
            if outputs is not None:
                outputs.close()
            outputs = self._outputs[decode_worker] = WorkerOutputs(self._actors.get(decode_worker), decode_worker)
        return outputs

    async def generate(self, decode_worker: str, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        import ray

        try:
            async with contextlib.aclosing(self._outputs_of(decode_worker).stream(request)) as stream:
                async for chunk in stream:
                    yield chunk
        except (ray.exceptions.RayActorError, OutputStreamLost) as e:
            died = isinstance(e if isinstance(e, ray.exceptions.RayActorError) else e.__cause__,
                              ray.exceptions.RayActorError)
            if died:  # its registry entry expires shortly
                self.forget([decode_worker])
            how = "died" if died else "is unreachable"
            raise WorkerUnreachable(f"decode worker {decode_worker!r} {how}: {e}") from e

    async def metrics(self, worker_id: str) -> bytes:
        return bytes(await self._actors.get(worker_id).metrics.remote())


class LocalWorkerClient:
    """Services living in this process (tests, benchmarks of the router alone)."""

    def __init__(self, decode: Mapping[str, DecodeService], others: Mapping[str, EngineService] | None = None):
        self.decode = dict(decode)
        self.services: dict[str, EngineService] = {**(others or {}), **self.decode}

    async def generate(self, decode_worker: str, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        service = self.decode.get(decode_worker)
        if service is None:
            raise WorkerUnreachable(f"no decode worker {decode_worker!r}")
        async with contextlib.aclosing(service.generate(request)) as stream:
            async for chunk in stream:
                yield chunk

    async def metrics(self, worker_id: str) -> bytes:
        return self.services[worker_id].metrics.exposition()

    def forget(self, worker_ids: list[str]) -> None:
        pass  # the services belong to the caller
