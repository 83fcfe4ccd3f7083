"""Thin Ray actors around the prefill and decode services (the logic lives in the services).

    p = start_prefill_worker("prefill-0", EngineConfig(), WorkerResources(num_gpus=1), transport="nixl")
    d = start_decode_worker("decode-0", EngineConfig(), WorkerResources(num_gpus=1), transport="nixl")
    async for chunk in stream_generate(d, GenerateRequest(..., prefill_worker="prefill-0")): ...

Actors are named (their worker id) so decode workers find prefill workers by id. Messages cross as
msgpack bytes (``workers.protocol.messages``); the decode worker's ``generate`` is a Ray streaming generator,
and cancelling it (``ray.cancel``) cancels the request on every worker it touched.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import ray

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.messages import GenerateRequest, PrefillRequest, TokenChunk, pack, unpack
from workers.resources import WorkerResources
from workers.service.base import EngineService
from workers.service.decode import DecodeService
from workers.service.output_server import OutputServer
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import RayPrefillClient
from workers.service.publisher import PublishConfig
from workers.transport.base import KVTransport
from workers.transport.factory import make_transport
from workers.transport.paced import PacedTransport


def _build(engine_config: EngineConfig, resources: WorkerResources, transport: str) -> tuple[Engine, KVTransport]:
    engine = Engine(engine_config)  # on this thread with one torch thread (ONE_OPENMP_TEAM): no team of its own
    kv_transport = make_transport(transport, _node_host(), engine.runner.device.type)
    if engine_config.timing_profile is not None:  # a timing model's transfers take the real model's time
        kv_transport = PacedTransport(kv_transport, engine_config.timing_profile, engine_config.block_size)
    return engine, kv_transport


def _node_host() -> str:
    """The address other nodes reach this worker at (its KV transport and output streams listen there)."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class _WorkerBase:
    service: EngineService

    def ready(self) -> dict[str, Any]:
        return {"worker_id": self.service.worker_id, "role": self.service.role, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(), "kv_address": self.service.transport.address(),
                "kv_cache": self.service.loop.engine.kv_cache_description,
                "engine_threads": self.service.loop.num_threads, "cpu_kernels": self._cpu_kernels()}

    def _cpu_kernels(self) -> str | None:
        """The compiled CPU kernels' instruction set where this worker's model runs on the CPU (None on a GPU or
        where they did not load): what TANDEM_CPU_ISA pins, shown when the worker is ready."""
        from kernels import cpu_kernel

        return cpu_kernel.instruction_set_in_use() if self.service.loop.engine.model.device.type == "cpu" else None

    async def load(self) -> bytes:
        return pack(await self.service.load())

    def metrics(self) -> bytes:
        return self.service.metrics.exposition()

    async def num_used_blocks(self) -> int:
        """KV blocks held by requests (evictable prefix cache excluded)."""
        return await self.service.loop.run(lambda e: e.block_pool.num_used_blocks)

    async def check_integrity(self) -> bool:
        """The KV block pool's invariants (free list, ref counts, prefix-cache index) hold; raises if not."""
        return await self.service.loop.run(lambda e: e.block_pool.check_integrity())

    def rss_bytes(self) -> int:
        """The worker process's resident memory (what a soak run watches for leaks)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def drain(self, grace_s: float = 1.0, timeout_s: float = 300.0) -> dict[str, Any]:
        """Leave routing, finish the in-flight requests, stop; the caller then ends the actor."""
        return dataclasses.asdict(await self.service.drain(grace_s, timeout_s))

    def shutdown(self) -> None:
        self.service.close()


class PrefillWorker(_WorkerBase):
    service: PrefillService

    def __init__(self, worker_id: str, engine_config: EngineConfig, resources: WorkerResources, transport: str,
                 publish: PublishConfig | None = None):
        engine, kv_transport = _build(engine_config, resources, transport)
        self.service = PrefillService(engine, kv_transport, worker_id, publish=publish,
                                      engine_threads=resources.engine_threads).start()

    async def prefill(self, data: bytes) -> bytes:
        return pack(await self.service.prefill(unpack(PrefillRequest, data)))

    async def cancel(self, request_id: str) -> bool:
        return await self.service.cancel(request_id)


class DecodeWorker(_WorkerBase):
    service: DecodeService

    def __init__(self, worker_id: str, engine_config: EngineConfig, resources: WorkerResources, transport: str,
                 namespace: str | None = None, transfer_timeout_s: float = 30.0,
                 publish: PublishConfig | None = None):
        engine, kv_transport = _build(engine_config, resources, transport)
        self.service = DecodeService(engine, kv_transport, worker_id, RayPrefillClient(namespace),
                                     transfer_timeout_s, publish, engine_threads=resources.engine_threads).start()
        self._outputs: OutputServer | None = None  # listening from the first router's ask

    async def generate(self, data: bytes) -> AsyncIterator[bytes]:
        try:
            request = unpack(GenerateRequest, data)
        except (ValueError, TypeError) as e:
            yield pack(_bad_message(e))
            return
        async for chunk in self.service.generate(request):
            yield pack(chunk)

    # A router's requests on one stream (output_channel.py): it connects to output_address once (its chunks come
    # there, output_server.py), then starts / cancels each request here.
    async def output_address(self) -> tuple[str, int]:
        if self._outputs is None:
            self._outputs = OutputServer(self.service, _node_host())
        return await self._outputs.start()

    async def start(self, channel_id: str, data: bytes) -> bytes | None:
        """Start a request on a subscribed channel: None, or the chunk that ends it at once (a bad message)."""
        try:
            request = unpack(GenerateRequest, data)
        except (ValueError, TypeError) as e:
            return pack(_bad_message(e))
        self.service.start_on(channel_id, request)
        return None

    async def cancel_request(self, channel_id: str, request_id: str) -> bool:
        return self.service.cancel_on(channel_id, request_id)

    async def renew_channel(self, channel_id: str) -> bool:
        return self.service.renew_channel(channel_id)

    def shutdown(self) -> None:
        if self._outputs is not None:
            self._outputs.close()
        super().shutdown()


def _bad_message(error: Exception) -> TokenChunk:
    """A message this worker cannot read (version skew): say why."""
    return TokenChunk("", finished=True, finish_reason="error", error=f"bad request message: {error}",
                      error_kind="invalid_request")


# Every thread of a worker process but the engine's runs torch on one thread. libgomp spins between parallel
# regions only while a process has no more OpenMP threads than cores; a second team (the actor's main thread
# loading the model with num_cpus threads) tips it into sleeping on a futex, and every region of a decode step
# pays a wake-up: 17-19 ms a step on 2 cores instead of 4.4 ms (bench_served_step.py).
ONE_OPENMP_TEAM = {"OMP_NUM_THREADS": "1"}


def actor_options(worker_id: str, resources: WorkerResources, namespace: str) -> dict[str, Any]:
    return {"name": worker_id, "namespace": namespace, "num_cpus": resources.num_cpus,
            "num_gpus": resources.num_gpus, "resources": dict(resources.resources),
            "max_concurrency": 10_000, "max_restarts": 0, "runtime_env": {"env_vars": ONE_OPENMP_TEAM}}


def start_prefill_worker(worker_id: str, engine_config: EngineConfig, resources: WorkerResources,
                         transport: str = "tcp", namespace: str | None = None,
                         publish: PublishConfig | None = None) -> Any:
    """``publish``: register in Redis and publish load and KV events there (what routers read)."""
    namespace = _namespace(namespace)
    cls = ray.remote(PrefillWorker).options(**actor_options(worker_id, resources, namespace))
    return cls.remote(worker_id, engine_config, resources, transport, _with_namespace(publish, namespace))


def start_decode_worker(worker_id: str, engine_config: EngineConfig, resources: WorkerResources,
                        transport: str = "tcp", namespace: str | None = None, transfer_timeout_s: float = 30.0,
                        publish: PublishConfig | None = None) -> Any:
    namespace = _namespace(namespace)
    cls = ray.remote(DecodeWorker).options(**actor_options(worker_id, resources, namespace))
    return cls.remote(worker_id, engine_config, resources, transport, namespace,
                      transfer_timeout_s, _with_namespace(publish, namespace))


def _with_namespace(publish: PublishConfig | None, namespace: str) -> PublishConfig | None:
    """Routers look the actor up by its id in this namespace."""
    return None if publish is None else dataclasses.replace(publish, ray_namespace=namespace)


def _namespace(namespace: str | None) -> str:
    """An explicit namespace: inside an actor, None would not find the driver's named actors."""
    if namespace is not None:
        return namespace
    if not ray.is_initialized():
        ray.init()
    return ray.get_runtime_context().namespace


async def stream_generate(decode_worker: Any, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
    """Stream a request's chunks from a decode worker actor; closing the iterator cancels the request."""
    refs = decode_worker.generate.options(num_returns="streaming").remote(pack(request))
    finished = False
    try:
        async for ref in refs:
            chunk = unpack(TokenChunk, await ref)
            finished = chunk.finished
            yield chunk
    finally:
        if not finished:
            ray.cancel(refs)
