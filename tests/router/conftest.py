"""A small cluster in this process: prefill 'p0' and decode 'd0' services publishing to a real
Redis, and a router served by uvicorn on a real port (the openai client talks real HTTP)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest

from router.policy import PolicyConfig
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient
from tests.router.serve import AppServer, serve_router
from workers.engine.engine import Engine
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.service.publisher import PublishConfig
from workers.transport.tcp import TcpTransport

MODEL = "tandem-test"


@pytest.fixture(scope="module")
def local_cluster(make_engine, redis_url) -> Iterator[tuple[AppServer, PrefillService, DecodeService]]:
    with running_cluster(redis_url, lambda: make_engine(max_model_len=2048)) as cluster:
        yield cluster


@contextlib.contextmanager
def running_cluster(redis_url: str, make_engine: Callable[[], Engine]
                    ) -> Iterator[tuple[AppServer, PrefillService, DecodeService]]:
    """p0 and d0 on engines from ``make_engine``, and a router over them."""
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    publish = PublishConfig(redis_url, cluster)
    prefill = PrefillService(make_engine(), TcpTransport(), "p0", publish=publish).start()
    decode = DecodeService(make_engine(), TcpTransport(), "d0",
                           LocalPrefillClient({"p0": prefill}), transfer_timeout_s=10.0, publish=publish).start()
    # Local prefill only for very short prompts, so most requests cross from p0 to d0.
    config = RouterConfig(redis_url, cluster, served_model_name=MODEL,
                          policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
    router = serve_router(config, LocalWorkerClient({"d0": decode}, {"p0": prefill}), decode.loop.engine.tokenizer,
                          min_workers=2)
    try:
        yield router, prefill, decode
    finally:
        router.stop()
        decode.close()
        prefill.close()
